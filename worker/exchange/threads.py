"""The exchange's own CPU thread budget, apart from the training's.

A site rank's exchange (compression, the replay, the replay check) runs on background threads beside
the training thread. torchrun sets `OMP_NUM_THREADS=1` for every rank, and a thread that never sets its
own count runs torch's CPU kernels on that one thread: the exchange of a GPU site crawled on one core
while the host's others idled. The opposite mistake — the exchange taking every core — slows a CPU
trainer beside it.

torch's OpenMP backend keeps the thread count per calling thread (`torch.set_num_threads` sets the
calling thread's OpenMP and MKL counts), so the exchange's threads get their own count without touching
the training thread's. The budget: what the operator asks for (`--exchange-threads`), or by default the
cores this process may use, shared by the ranks on this node, less the training thread's own torch
threads — at least 1.
"""

from __future__ import annotations

import os

import structlog
import torch

log = structlog.get_logger()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a Slurm or cgroup cpuset), else all."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def exchange_thread_budget(
    requested: int = 0, training_threads: int | None = None, local_ranks: int | None = None
) -> int:
    """Torch threads for the exchange of this rank. `requested` > 0 is taken as it is; 0 is the default
    above. Call it on the training thread: `training_threads` defaults to that thread's torch count (and
    asking for it first fixes the training thread's count before any exchange thread sets its own)."""
    if requested < 0:
        raise ValueError(f"exchange threads must be ≥ 0 (0: automatic), got {requested}")
    if requested > 0:
        return requested
    train = torch.get_num_threads() if training_threads is None else training_threads
    ranks = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, usable_cores() // max(1, ranks) - train)


def use_exchange_threads(threads: int) -> None:
    """Give the calling (exchange) thread its torch thread count; the training thread keeps its own."""
    torch.set_num_threads(max(1, threads))
