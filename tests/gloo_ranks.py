"""Real ranks on a gloo process group for a test: each a fresh process, forked from a forkserver.

Why a forkserver and not `spawn`: a spawned rank imports torch, the site and (for a Hugging Face model)
transformers before it runs a line of the test, 3-6 s of CPU a rank, and the suite starts some 70 of them.
The forkserver imports those once (`PRELOAD`, set in tests/conftest.py) and forks each rank from that state
in milliseconds. A rank is still its own process that builds its own gloo group; it takes the forkserver's
environment, not the test's at the time of the start, so every rank function sets the variables it needs
itself (`MASTER_*`, `RANK`, ...), and the forkserver is started from the run's clean environment
(conftest's `rank_forkserver`, a session fixture set up before any test's monkeypatch)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import free_port

RANK_START = "forkserver"
# What every rank imports anyway; a module missing here (e.g. transformers not installed) is skipped by the
# forkserver and imported by the rank that needs it.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "dilocox.worker.site.trainer",
    "dilocox.worker.site.mesh",
    "dilocox.worker.checkpoint",
    "transformers.models.llama.modeling_llama",  # llama-tiny, the site tests' model
]


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """This process as torchrun would start rank `rank` of `world` on one node (the variables `SiteMesh`
    reads), on one torch thread."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)


def start_ranks(target: Callable, world: int, args: tuple) -> None:
    """`target(rank, *args)` on `world` fresh processes (a module-level function: it is pickled by name),
    returning once each has exited cleanly; raises with a failed rank's traceback, as `mp.spawn` does."""
    mp.start_processes(target, args=args, nprocs=world, join=True, start_method=RANK_START)


def _entry(target: Callable, rank: int, world: int, port: int, queue, args: tuple) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, target(rank, *args)))
        # No rank tears the group down, and with rank 0 the store, while another still builds a subgroup of
        # its own through that store (a mesh dimension of size 1: rank 0 finished first once, under load).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(target: Callable, world: int, *args: object, timeout_s: float = 120.0) -> list:
    """`target(rank, *args)` on `world` ranks of one gloo group (a module-level function: it is pickled by
    name); returns what each returned, in rank order, once every rank has exited cleanly."""
    ctx = mp.get_context(RANK_START)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=timeout_s) for _ in procs), key=lambda item: item[0])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, (p.exitcode, results)
    return [value for _, value in results]
