"""The byte-level corpus, its train/eval split, and per-cluster batch sampling.

Bytes are tokens (vocabulary 256), so any file is a corpus and there is no tokenizer to ship. Each
cluster samples only from its own contiguous shard of the training bytes so that clusters see
different data, as DiLoCo's clusters would; every random choice goes through a per-cluster
`torch.Generator` so that a run is reproducible and resumable without touching global RNG state.
"""

from __future__ import annotations

import importlib.resources
import os
import pathlib
from typing import Any

import torch
import torch.nn as nn


class CorpusError(ValueError):
    """The corpus cannot be used: missing, empty, or too small for the requested block size."""


def default_corpus_path() -> pathlib.Path:
    """The bundled tinyshakespeare, so that `dilocox sim` works with no data argument."""
    return pathlib.Path(str(importlib.resources.files("dilocox.common") / "data" / "tinyshakespeare.txt"))


def _is_hidden(rel: pathlib.PurePath) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def load_corpus(path: str | os.PathLike | None = None, block_size: int | None = None) -> bytes:
    """Read a corpus: None -> the bundled default; a file -> its bytes; a folder -> every regular,
    non-hidden file under it (recursive, sorted by relative POSIX path so the order does not depend
    on the filesystem), joined by b"\\n". With `block_size`, also check it holds one training window."""
    p = default_corpus_path() if path is None else pathlib.Path(path)
    if not p.exists():
        raise CorpusError(f"corpus path does not exist: {p}")
    if p.is_file():
        data = p.read_bytes()
        if not data:
            raise CorpusError(f"corpus file is empty: {p}")
    elif p.is_dir():
        files: list[tuple[str, pathlib.Path]] = []
        for root, dirs, names in os.walk(p):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in names:
                full = pathlib.Path(root) / name
                rel = full.relative_to(p)
                if not _is_hidden(rel) and full.is_file():
                    files.append((rel.as_posix(), full))
        files.sort(key=lambda item: item[0])
        pieces = [full.read_bytes() for _, full in files]
        if not any(pieces):
            raise CorpusError(f"corpus folder has no non-empty, non-hidden regular files: {p}")
        data = b"\n".join(pieces)
    else:
        raise CorpusError(f"corpus path is neither a regular file nor a folder: {p}")
    if block_size is not None:
        check_size(len(data), block_size)
    return data


def _eval_len(n_bytes: int, eval_fraction: float) -> int:
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    return int(n_bytes * eval_fraction)


def check_size(n_bytes: int, block_size: int, *, eval_fraction: float = 0.0, num_shards: int = 1) -> None:
    """Raise CorpusError unless every training shard (and the eval set, if any) holds at least one
    window of block_size + 1 bytes (inputs plus the shifted targets). Call it before training so
    the error names the corpus rather than surfacing as an indexing failure deep in a sampler."""
    if block_size <= 0 or num_shards <= 0:
        raise ValueError("block_size and num_shards must be positive")
    need = block_size + 1
    n_eval = _eval_len(n_bytes, eval_fraction)
    smallest_shard = (n_bytes - n_eval) // num_shards
    if smallest_shard < need:
        raise CorpusError(
            f"corpus too small: {n_bytes} bytes gives {smallest_shard} training bytes per shard "
            f"({num_shards} shard(s), eval_fraction={eval_fraction}); need at least {need} "
            f"(block_size {block_size} + 1)"
        )
    if eval_fraction > 0 and n_eval < need:
        raise CorpusError(
            f"corpus too small: eval set is {n_eval} bytes, need at least {need} (block_size {block_size} + 1)"
        )


def split_corpus(data: bytes, eval_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) uint8 tensors; eval is the LAST eval_fraction of the bytes, so it is a
    contiguous held-out text that no training window overlaps."""
    n_eval = _eval_len(len(data), eval_fraction)
    all_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    split = len(data) - n_eval
    return all_bytes[:split].clone(), all_bytes[split:].clone()


def _mix_seed(seed: int, shard_index: int) -> int:
    """One 63-bit seed per (seed, shard): neighbouring shards must not get correlated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + shard_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) % 2**64
    x ^= x >> 29
    return x % 2**63


class BatchSampler:
    """Random (x, y) windows from this cluster's contiguous 1/num_shards of the training bytes."""

    def __init__(
        self,
        train: torch.Tensor,
        block_size: int,
        batch_size: int,
        seed: int,
        shard_index: int = 0,
        num_shards: int = 1,
    ) -> None:
        if num_shards <= 0 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        if block_size <= 0 or batch_size <= 0:
            raise ValueError("block_size and batch_size must be positive")
        n = train.numel()
        self.start = n * shard_index // num_shards
        self.end = n * (shard_index + 1) // num_shards
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.shard_index = shard_index
        self.num_shards = num_shards
        shard = train.reshape(-1)[self.start : self.end]
        if shard.numel() < block_size + 1:
            raise CorpusError(
                f"shard {shard_index}/{num_shards} has {shard.numel()} bytes, need at least "
                f"{block_size + 1} (block_size + 1)"
            )
        # Every window of block_size + 1 bytes as a view; a batch gathers only the rows it needs.
        self._windows = shard.unfold(0, block_size + 1, 1)
        self._gen = torch.Generator().manual_seed(_mix_seed(seed, shard_index))
        self.batches_drawn = 0

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this shard in the training tensor."""
        return self.start, self.end

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 [batch_size, block_size]; y is x shifted left by one byte."""
        ix = torch.randint(0, self._windows.size(0), (self.batch_size,), generator=self._gen)
        w = self._windows[ix].long()
        self.batches_drawn += 1
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Generator state + count, plus the identity of the stream so a mismatched resume fails."""
        return {
            "generator": self._gen.get_state(),
            "batches_drawn": self.batches_drawn,
            "seed": self.seed,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shard_index", "num_shards", "block_size", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state is for {key}={state[key]}, this sampler has {getattr(self, key)}")
        self._gen.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


def eval_windows(n_bytes: int, block_size: int, count: int) -> torch.Tensor:
    """`count` window starts spread evenly over the eval data: fixed, so eval losses are comparable
    across rounds and clusters without any randomness."""
    last = n_bytes - (block_size + 1)
    if last < 0:
        raise CorpusError(f"eval data has {n_bytes} bytes, need at least {block_size + 1} (block_size + 1)")
    return torch.linspace(0, last, count, dtype=torch.float64).round().long()


@torch.no_grad()
def evaluate(
    model: nn.Module, eval_data: torch.Tensor, block_size: int, batch_size: int, num_batches: int
) -> float:
    """Mean loss (nats) over a fixed set of evenly spaced eval windows; the model's mode is restored."""
    if batch_size <= 0 or num_batches <= 0:
        raise ValueError("batch_size and num_batches must be positive")
    starts = eval_windows(eval_data.numel(), block_size, batch_size * num_batches)
    windows = eval_data.reshape(-1).unfold(0, block_size + 1, 1)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for b in range(num_batches):
            w = windows[starts[b * batch_size : (b + 1) * batch_size]].long().to(device)
            _, loss = model(w[:, :-1], w[:, 1:])
            total += float(loss)
        return total / num_batches
    finally:
        model.train(was_training)
