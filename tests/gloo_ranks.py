"""Real ranks on a gloo process group for a test: each a spawned process running one function."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import free_port


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
    """`target(rank, *args)` on `world` ranks of one gloo group (a module-level function: it is spawned);
    returns what each returned, in rank order, once every rank has exited cleanly."""
    ctx = mp.get_context("spawn")
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
