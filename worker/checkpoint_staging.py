"""What a site checkpoint stages, and how a refused save reads (worker/checkpoint.py).

Staging: DCP's `async_save` copies every rank's whole state to host memory before writing it in the
background, whatever its planner later de-duplicates. Replicated state (HSDP's dp_replicate, plain
replication) is the same on every replica, so only the first stages it (`written_once`).

Reuse: `async_save` makes a new stager per save by default, so every checkpoint allocated (and on a GPU
would pin) 12 B per held parameter afresh and freed it after the write. `reusable_stager` is one DCP
`DefaultStager` kept by the site: its cache maps each live storage (a parameter's shard, a moment) to its
staged copy, refilled in place at the next checkpoint; pinned by registering the buffer with CUDA
(`cudaHostRegister`, as DCP does), not by torch's caching host allocator, which rounds each block up to a
power of two (up to +100 %). The buffers are then held between checkpoints: what `checkpoint_staging =
"sync"` avoids, at the cost of the site waiting for the write.

Failures: a full disk, an I/O error or a read-only folder reach the site as the storage's own error
(torch reports some as RuntimeError) or as DCP's CheckpointException, which gathers every rank's failure
and is a BaseException. `SAVE_ERRORS` names both; `first_line` says the first failing rank's reason.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor, Replicate

from dilocox.common.wire.checkpoint_format import one_line

# What a refused save raises: the storage's own errors (torch reports some as RuntimeError) and DCP's
# CheckpointException, which gathers every rank's failure (a BaseException, so named apart).
SAVE_ERRORS = (Exception, CheckpointException)


def written_once(state: dict) -> dict:
    """`state` without the replicated copies this rank need not stage: a DTensor replicated along a mesh
    dimension (HSDP's dp_replicate, plain replication) is the same on every coordinate of it, and DCP
    writes one copy anyway (its planner de-duplicates), but `async_save` stages every rank's whole state to
    host memory first — 12 B per held parameter of weights and AdamW on every replica. Only coordinate 0
    of each replicated dimension keeps it; the others stage nothing of it, and every rank loads it back
    (the load reads by name and offset, whoever wrote it)."""
    return {name: value for name, value in state.items() if not _replica_copy(value)}


def _replica_copy(value: object) -> bool:
    if not isinstance(value, DTensor):
        return False
    coordinate = value.device_mesh.get_coordinate()
    return coordinate is not None and any(
        isinstance(p, Replicate) and coordinate[dim] != 0 for dim, p in enumerate(value.placements)
    )


def reusable_stager(pinned: bool) -> DefaultStager:
    """A stager whose staged buffers the next checkpoint refills (see the module docstring); `pinned` where
    a GPU copies into them and CUDA is there. Staging itself stays synchronous (the boundary returns once
    the state is copied), the write goes on in DCP's thread."""
    pinned = pinned and torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )


def tensor_bytes(state: object) -> int:
    """Bytes of the tensors in a (nested) state dict, as this rank holds them: what staging copies."""
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def settled(future: Future) -> str | None:
    """Wait for `future`; its error as one line, or None."""
    try:
        future.result()
    except SAVE_ERRORS as error:  # a failed write is reported by the caller, never raised
        return first_line(error)
    return None


def first_line(error: BaseException) -> str:
    """One line for a failed save; for DCP's CheckpointException (every rank's failures gathered) the first
    failing rank's own exception."""
    rank = ""
    if isinstance(error, CheckpointException) and error.failures:
        first = min(error.failures)
        rank, error = f"rank {first}: ", error.failures[first][0]
    return f"{rank}{one_line(error)}"[:300]
