"""Moving a stage's parameters between the layout FSDP keeps them in and the layout the exchange needs.

FSDP holds every parameter of a stage split by rows over the stage's dp_shard ranks (torch.chunk's
split: chunks of ⌈rows / dp_shard⌉). The exchange wants each parameter whole on one rank: its *owner*,
which computes its pseudo-gradient, compresses, pushes, pulls and replays it — so a slice's low-rank
factors, its bytes on the wire and its replay do not depend on the site's layout (docs/decisions.md,
"A rank owns whole parameters"). Owners are spread over the stage's dp ranks by element count.

At a round boundary `gather` brings each owned parameter's rows from the ranks holding them into the
owner's host buffer, and `scatter` sends the owner's new values back to every rank holding rows of them
(in HSDP or plain replication, to each replica). Both are `all_to_all_single` over the stage's dp group
on the device (NVLink/InfiniBand inside a site), in batches of at most `batch_elements` elements (a larger
parameter cut by rows), so no model-sized or parameter-sized buffer exists on the device, and the two
buffers are released after each gather and scatter; on the host the owner only ever holds its own parameters.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dilocox.worker.exchange.host_buffers import host_empty
from dilocox.worker.models.materialize import (
    held_rows,
)  # FSDP2's row chunks: one definition for the build and the reshard
from dilocox.worker.site.mesh import SiteShape

BATCH_ELEMENTS = 64 * 2**20  # 256 MB of fp32 per collective, at most


def owners_by_size(sizes: dict[str, int], dp: int) -> dict[str, int]:
    """Which replica of the stage owns each parameter: largest first onto the least-loaded replica
    (LPT), ties by name; the same on every rank."""
    loads = [(0, d) for d in range(dp)]  # a heap of (load, replica): its top is the least loaded, lowest index
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, replica = heapq.heappop(loads)
        owner[name] = replica
        heapq.heappush(loads, (load + sizes[name], replica))
    return owner


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of parameter `name`, moving from replica `src` to replica `dst`."""

    name: str
    start: int
    stop: int
    src: int
    dst: int


class StageResharder:
    """The pieces of a stage's parameters that move at a boundary, planned once from shapes alone."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        shape: SiteShape,
        replica: int,
        sharded: bool,
        batch_elements: int = BATCH_ELEMENTS,
    ) -> None:
        """`shapes`: the stage's parameters (global shapes, stage order). `sharded`: whether FSDP splits
        the rows over dp_shard (else every rank holds every row)."""
        self.shapes = dict(shapes)
        self.shape = shape
        self.replica = replica
        self.sharded = sharded
        self.row_numel = {n: math.prod(s[1:]) if len(s) > 1 else 1 for n, s in self.shapes.items()}
        self.owner = owners_by_size({n: math.prod(s) for n, s in self.shapes.items()}, shape.dp)
        self.owned = [n for n in self.shapes if self.owner[n] == replica]
        # A scatter sends the owner's rows to every replica holding them: batches are cut so that even
        # that fan-out stays within the limit.
        fan_out = self.shape.dp_replicate if sharded else self.shape.dp
        self.batches = self._batches(max(1, batch_elements // fan_out))
        self.gather_pieces = [self._gather_pieces(batch) for batch in self.batches]
        self.scatter_pieces = [self._scatter_pieces(batch) for batch in self.batches]

    def rows_of(self, name: str, replica: int) -> tuple[int, int]:
        rows = self.shapes[name][0] if self.shapes[name] else 1
        if not self.sharded:
            return 0, rows
        return held_rows(rows, self.shape.shard_coordinate(replica), self.shape.dp_shard)

    def _batches(self, limit: int) -> list[list[tuple[str, int, int]]]:
        """Rows [start, stop) of the stage's parameters, in order, cut into batches of at most `limit`
        elements: a parameter larger than the limit is cut by rows (at least one row a segment), so no
        all_to_all moves more than the batch limit into or out of a rank."""
        batches: list[list[tuple[str, int, int]]] = []
        current: list[tuple[str, int, int]] = []
        size = 0
        for name, shape in self.shapes.items():
            rows, per_row = (shape[0] if shape else 1), self.row_numel[name]
            start = 0
            while start < rows:
                if current and limit - size < per_row:
                    batches.append(current)
                    current, size = [], 0
                take = min(rows - start, max(1, (limit - size) // per_row))
                current.append((name, start, start + take))
                size += take * per_row
                start += take
        if current:
            batches.append(current)
        return batches

    def _row_chunks(self, name: str) -> list[tuple[int, int, int]]:
        """(shard coordinate, start, stop) of every non-empty row chunk of `name`."""
        shards = self.shape.dp_shard if self.sharded else 1
        rows = self.shapes[name][0] if self.shapes[name] else 1
        chunks = [(k, *held_rows(rows, k, shards)) for k in range(shards)]
        return [c for c in chunks if c[2] > c[1]]

    def _chunks_in(self, name: str, first: int, last: int) -> list[tuple[int, int, int]]:
        """(shard coordinate, start, stop) of the row chunks of `name` within rows [first, last)."""
        cut = [(k, max(start, first), min(stop, last)) for k, start, stop in self._row_chunks(name)]
        return [c for c in cut if c[2] > c[1]]

    def _gather_pieces(self, batch: list[tuple[str, int, int]]) -> list[Piece]:
        """Each row chunk goes to the parameter's owner from the replica that holds it and shares the
        owner's replicate coordinate (the owner itself, where it holds those rows)."""
        pieces = []
        for name, first, last in batch:
            owner = self.owner[name]
            replicate = self.shape.replicate_coordinate(owner)
            for k, start, stop in self._chunks_in(name, first, last):
                src = self.shape.replica_with(replicate, k) if self.sharded else owner
                pieces.append(Piece(name, start, stop, src, owner))
        return pieces

    def _scatter_pieces(self, batch: list[tuple[str, int, int]]) -> list[Piece]:
        """The owner sends every row chunk to every replica holding it."""
        pieces = []
        for name, first, last in batch:
            owner = self.owner[name]
            for k, start, stop in self._chunks_in(name, first, last):
                for replicate in range(self.shape.dp_replicate if self.sharded else self.shape.dp):
                    dst = self.shape.replica_with(replicate, k) if self.sharded else replicate
                    pieces.append(Piece(name, start, stop, owner, dst))
        return pieces


class Resharder:
    """Runs the plan of a `StageResharder` on this rank's parameters (collectives on the stage's group)."""

    def __init__(self, plan: StageResharder, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.plan = plan
        self.group = group
        self.device = device
        self._buffers = [torch.empty(0, device=device), torch.empty(0, device=device)]  # send, receive
        self._host = torch.empty(0)  # gather_rows's landing buffer on the host

    def check(self, local: dict[str, torch.Tensor]) -> None:
        """`local`: this rank's part of each parameter (`parallelize.local_part`) must hold the rows the
        plan says (torch.chunk's split, which FSDP2 uses)."""
        for name, tensor in local.items():
            start, stop = self.plan.rows_of(name, self.plan.replica)
            rows = tensor.shape[0] if tensor.dim() else 1
            if rows != stop - start:
                raise RuntimeError(
                    f"{name}: this rank holds {rows} rows, the reshard plan expects {stop - start} "
                    f"(rows {start}–{stop}); FSDP's sharding is not torch.chunk's"
                )

    @staticmethod
    def _rows(tensor: torch.Tensor, piece: Piece, offset: int = 0) -> torch.Tensor:
        """The piece's rows of a tensor whose first row is its parameter's row `offset`, flattened (a view)."""
        if tensor.dim() == 0:
            return tensor.reshape(1)
        return tensor[piece.start - offset : piece.stop - offset].reshape(-1)

    def _local_rows(self, local: dict[str, torch.Tensor], piece: Piece) -> torch.Tensor:
        """The piece's rows of this rank's part of its parameter."""
        return self._rows(local[piece.name], piece, self.plan.rows_of(piece.name, self.plan.replica)[0])

    def _buffer(self, which: int, numel: int) -> torch.Tensor:
        """One of two flat buffers on the device, kept between the batches of one gather or scatter (at
        most the batch limit each) and released at its end."""
        if self._buffers[which].numel() < numel:
            self._buffers[which] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._buffers[which][:numel]

    def _exchange(
        self, pieces: list[Piece], read: Callable[[Piece], torch.Tensor], write: Callable[[Piece], torch.Tensor]
    ) -> None:
        """Move `pieces`: each from `read(piece)` on its source to `write(piece)` on its destination (both
        flat views). Pieces that stay on this rank are copied directly; the rest go through one
        all_to_all_single over the stage's group."""
        me, dp = self.plan.replica, self.plan.shape.dp
        numel = lambda p: (p.stop - p.start) * self.plan.row_numel[p.name]  # noqa: E731
        for p in pieces:
            if p.src == me and p.dst == me:
                write(p).copy_(read(p), non_blocking=True)
        if dp == 1:
            return
        outgoing = sorted((p for p in pieces if p.src == me and p.dst != me), key=lambda p: p.dst)  # stable: plan order
        incoming = sorted((p for p in pieces if p.dst == me and p.src != me), key=lambda p: p.src)
        send = self._buffer(0, sum(numel(p) for p in outgoing))
        offset = 0
        for p in outgoing:
            send[offset : offset + numel(p)].copy_(read(p), non_blocking=True)
            offset += numel(p)
        recv = self._buffer(1, sum(numel(p) for p in incoming))
        send_splits = [sum(numel(p) for p in outgoing if p.dst == d) for d in range(dp)]
        recv_splits = [sum(numel(p) for p in incoming if p.src == d) for d in range(dp)]
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group)
        offset = 0
        for p in incoming:
            write(p).copy_(recv[offset : offset + numel(p)], non_blocking=True)
            offset += numel(p)

    @torch.no_grad()
    def gather(self, local: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
        """Every owned parameter, whole, into `out` (host tensors of the full shapes), from every rank's
        `local` rows."""
        for pieces in self.plan.gather_pieces:
            self._exchange(pieces, lambda p: self._local_rows(local, p), lambda p: self._rows(out[p.name], p))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host reads `out` next
        self._release()

    @torch.no_grad()
    def gather_rows(
        self,
        local: dict[str, torch.Tensor],
        land: Callable[[str, int, int, torch.Tensor], None],
        pinned: bool = False,
        keep: bool = True,
    ) -> None:
        """Every owned parameter's rows handed to `land(name, first, last, rows)` batch by batch, through
        one host buffer of at most a batch (kept for the run: page-locked where `pinned`, and allocating
        that anew at every boundary is slow) — so the owner folds θ into its own state without a buffer
        of its owned parameters (worker/exchange/outgoing.py). `keep=False`: pageable, and freed at the
        end (a site keeping its host memory lean, `spill_dir`: a fixed 256 MB is not held through training)."""
        pinned = pinned and keep  # pinned memory freed goes to torch's host cache, not back to the system
        me = self.plan.replica
        numel = lambda p: (p.stop - p.start) * self.plan.row_numel[p.name]  # noqa: E731
        for pieces in self.plan.gather_pieces:
            mine = [p for p in pieces if p.dst == me]
            need = sum(numel(p) for p in mine)
            if self._host.numel() < need:
                self._host = host_empty(need, pinned)
            offsets, offset = {}, 0
            for p in mine:
                offsets[p] = offset
                offset += numel(p)
            self._exchange(
                pieces, lambda p: self._local_rows(local, p), lambda p, at=offsets: self._host[at[p] : at[p] + numel(p)]
            )
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the host reads the buffer next
            for p in mine:
                land(p.name, p.start, p.stop, self._host[offsets[p] : offsets[p] + numel(p)])
        if not keep:
            self._host = torch.empty(0)
        self._release()

    @torch.no_grad()
    def scatter(self, local: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
        """The owned parameters' new `values` (host) into every rank's `local` rows of them."""
        for pieces in self.plan.scatter_pieces:
            self._exchange(pieces, lambda p: self._rows(values[p.name], p), lambda p: self._local_rows(local, p))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host may change `values` next
        self._release()

    def _release(self) -> None:
        """The boundary's buffers go back to the device between boundaries: training needs the memory."""
        self._buffers = [torch.empty(0, device=self.device), torch.empty(0, device=self.device)]
