"""`dilocox plan --measure`: run a layout's ranks on this machine (one process per rank: gloo on the CPU,
NCCL on the GPUs with `--device cuda`) and compare each rank's measured memory with the plan.

A rank's measurement is its resident set above what it held before the model was built (Python, torch,
the process group): after materialising its shard (`init`), and — unless `--init-only` — the peak over
two inner steps of the real `SiteTrainer` (forward, backward, clipping, AdamW; the second is the steady
one, AdamW's state allocated by the first). On the CPU, device memory
*is* host memory, so the planned figure is the device plan of that moment (the round boundary's reshard
buffers excluded: no exchange runs here) — plus, at init, the whole parameter a rank holds while making it.
On a GPU the measure is `torch.cuda.max_memory_allocated` above what was allocated before the build, set
against the same device plan (at the GPU's precision, with fused attention): what `dilocox bench gpu`
cannot show for a model too large for the CPU exchange to keep up with.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch
import torch.multiprocessing as mp

from dilocox.common.config.run import RunConfig
from dilocox.worker.site.memory_plan import MemoryPlan

PAGE = os.sysconf("SC_PAGE_SIZE")
MALLOC_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def reset_peak_rss() -> None:
    """Start this process's peak resident set afresh from its current one (Linux's clear_refs "5").

    Not `getrusage`'s ru_maxrss: Linux carries it across exec, so a rank spawned from a large parent (a
    test worker that has run hundreds of tests) reports the parent's peak, not its own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """The peak resident set of this process's memory since it began or since `reset_peak_rss` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: cannot measure peak memory on this system")


@dataclasses.dataclass
class RankMeasure:
    rank: int
    init: int  # bytes above the baseline once the shard is made (peak during the making)
    step: int | None  # peak bytes above the baseline over two inner steps (the second one steady)


def planned_init(plan: MemoryPlan, rank: int) -> int:
    r = plan.ranks[rank]
    return r.device["weights"] + r.host["build"]


def planned_step(plan: MemoryPlan, rank: int) -> int:
    r = plan.ranks[rank]
    return r.device_total - r.device["reshard"]


def _rank(rank: int, world: int, port: int, config: RunConfig, init_only: bool, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    # One thread on the CPU (the measure is the rank's own memory); on GPUs the host only draws the initial
    # weights (worker/models/materialize.py), which at 8B took over 90 s on one thread: give it the cores.
    on_cuda = config.parallel.device.startswith("cuda")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world) if on_cuda else 1)
    from dilocox.worker.data.corpus import load_corpus
    from dilocox.worker.data.token_data import EVAL_FRACTION, TokenData
    from dilocox.worker.models.build import meta_model
    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import SiteTrainer

    data = TokenData.from_bytes(load_corpus(None), EVAL_FRACTION)
    mesh = SiteMesh(config.parallel, collective_timeout_s=600)
    on_gpu = mesh.compute.is_cuda
    try:
        meta_model(config.model, data.vocab_size)  # the model's code imported (transformers), nothing allocated
        torch.distributed.barrier()
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            peak = torch.cuda.max_memory_allocated
        else:
            baseline = rss_bytes()
            reset_peak_rss()
            peak = peak_rss_bytes
        if init_only:
            from dilocox.worker.site.trainer import build_site_module

            build_site_module(config, data.vocab_size, mesh)
            init = peak() - baseline
            step = None
        else:
            trainer = SiteTrainer(config, data, mesh)
            init = peak() - baseline
            trainer.train_steps(2)  # the second step is the steady one: AdamW's state exists from the first on
            step = peak() - baseline
        torch.distributed.barrier()
        torch.save(RankMeasure(rank, init, step), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        mesh.close()


def measured_config(config: RunConfig) -> RunConfig:
    """The configuration `measure` runs: as given on the GPUs (`--device cuda`), else on the CPU in fp32."""
    if config.parallel.device.startswith("cuda"):
        return config
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, device="cpu", precision="fp32"))


def measure(config: RunConfig, init_only: bool = False) -> list[RankMeasure]:
    """Each rank's measured bytes for `config`'s layout: on the GPUs where its device is cuda (NCCL, one
    GPU per rank), else on the CPU (gloo, fp32)."""
    from dilocox.common.subprocesses import free_local_port

    world = config.parallel.world_size
    if config.parallel.device.startswith("cuda") and torch.cuda.device_count() < world:
        raise SystemExit(
            f"dilocox plan --measure: the layout has {world} ranks, one GPU each; this machine has "
            f"{torch.cuda.device_count()} GPU(s) (--device cpu measures it on the CPU)"
        )
    config = measured_config(config)
    # glibc raises its mmap threshold as large blocks are freed, after which freed memory stays resident:
    # a fixed threshold returns every large block at its free, so the resident set follows live memory.
    before = os.environ.get(MALLOC_THRESHOLD)
    os.environ[MALLOC_THRESHOLD] = str(1 << 16)
    try:
        with tempfile.TemporaryDirectory(prefix="dilocox-plan-") as out:
            mp.spawn(_rank, args=(world, free_local_port(), config, init_only, out), nprocs=world, join=True)
            return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    finally:
        if before is None:
            os.environ.pop(MALLOC_THRESHOLD, None)
        else:
            os.environ[MALLOC_THRESHOLD] = before
