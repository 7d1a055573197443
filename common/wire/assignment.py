"""Which shard owns which parameter rows: deterministic, balanced by element count.

Every participant (each shard and each cluster rank) computes the same assignment from the same
inputs — the ordered (name, shape) list and the shard count — so nothing about it has to be agreed
over the network beyond the model digest.

Balance: tensors larger than half of a shard's fair share are split by rows into pieces no larger than
that, then pieces are placed largest-first on the least-loaded shard (LPT). A shard's load can then
exceed the mean by at most one piece — ≤ 1.5× the mean in the worst case; on real models, with many
tensors to even out, it measures ≤ 1.05× (the tests check 1.25×).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dilocox.common.wire.framing import SliceKey

# Pieces are at most (total / num_shards) / SPLIT_FRACTION elements. 2, not finer: each row piece of a
# matrix is compressed on its own, and a low-rank piece costs (its rows + all columns) × rank, so
# splitting a matrix into k pieces repeats the column factor k times (docs/decisions.md).
SPLIT_FRACTION = 2


@dataclass(frozen=True)
class ParamSlice:
    """Rows [row_start, row_stop) of parameter `name` (full shape `shape`), owned by `shard`."""

    name: str
    shape: tuple[int, ...]
    row_start: int
    row_stop: int
    shard: int

    @property
    def key(self) -> SliceKey:
        return SliceKey(self.name, self.row_start, self.row_stop)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def numel(self) -> int:
        return (self.row_stop - self.row_start) * self.row_numel

    @property
    def slice_shape(self) -> tuple[int, ...]:
        if not self.shape:
            return ()
        return (self.row_stop - self.row_start, *self.shape[1:])

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of `tensor` (the full parameter) this slice covers; a view, so writes go through."""
        if not self.shape:
            return tensor
        return tensor[self.row_start : self.row_stop]


def model_digest(params: Iterable[tuple[str, Sequence[int]]]) -> str:
    """sha256 over the ordered parameter names and shapes: two models agree iff their digests do."""
    h = hashlib.sha256()
    for name, shape in params:
        h.update(f"{name}:{','.join(str(int(d)) for d in shape)};".encode())
    return h.hexdigest()


def tokenizer_digest_of(definition: str) -> str:
    """A tokenizer's identity, over its Hugging Face `tokenizer.json` text ("byte" has no file and is
    its own identity): workers record it in prepared data, shards record and check it at every join."""
    return "sha256:" + hashlib.sha256(definition.encode()).hexdigest()


def assign_slices(params: Sequence[tuple[str, Sequence[int]]], num_shards: int) -> list[ParamSlice]:
    """Split and place every parameter; returns slices ordered by (parameter order, row_start)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be ≥ 1, got {num_shards}")
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    total = sum(math.prod(shape) for _, shape in params)
    max_piece = max(1, total // (num_shards * SPLIT_FRACTION))

    pieces: list[tuple[int, int, str, tuple[int, ...], int, int]] = []  # (-numel, order, name, shape, start, stop)
    for order, (name, shape) in enumerate(params):
        shape = tuple(int(d) for d in shape)
        rows = shape[0] if shape else 1
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        numel = rows * row_numel
        n_pieces = 1 if numel <= max_piece or rows <= 1 else min(rows, math.ceil(numel / max_piece))
        bounds = [rows * i // n_pieces for i in range(n_pieces + 1)]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            pieces.append((-(stop - start) * row_numel, order, name, shape, start, stop))

    pieces.sort()
    loads = [0] * num_shards
    placed: list[tuple[int, int, ParamSlice]] = []
    for neg_numel, order, name, shape, start, stop in pieces:
        shard = min(range(num_shards), key=lambda s: (loads[s], s))
        loads[shard] -= neg_numel
        placed.append((order, start, ParamSlice(name, shape, start, stop, shard)))
    placed.sort(key=lambda item: (item[0], item[1]))
    return [s for _, _, s in placed]


def slices_of_shard(slices: Iterable[ParamSlice], shard: int) -> list[ParamSlice]:
    return [s for s in slices if s.shard == shard]


@dataclass(frozen=True)
class SliceMap:
    """The run's slices by position in the assignment: a bundle names its slices by that position
    (`common.bundle`), which both ends know from Join, instead of by name, rows and shape."""

    entries: tuple[tuple[SliceKey, tuple[int, ...]], ...]  # position → (key, slice shape)
    index: Mapping[SliceKey, int]  # key → position

    @classmethod
    def of(cls, assignment: Sequence[ParamSlice]) -> SliceMap:
        return cls(tuple((s.key, s.slice_shape) for s in assignment), {s.key: i for i, s in enumerate(assignment)})
