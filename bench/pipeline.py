"""`dilocox bench pipeline`: inner-step throughput of a PP=2 cluster vs one process, same machine.

Runs the default model's inner steps (no shards involved: this measures the pipeline, not the WAN),
PP=1 in this process and PP=2 as two gloo (CPU) or NCCL (GPU) ranks, and reports tokens per second.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dilocox.bench.report import write_report
from dilocox.common.config.run import InnerConfig, ParallelConfig, RunConfig
from dilocox.common.subprocesses import free_local_port
from dilocox.worker.data.corpus import load_corpus
from dilocox.worker.train.inner_trainer import InnerTrainer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="timed inner steps (default 30, after 3 warm-up)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per inner step (default 16)")
    parser.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per step through the pipeline (default 4)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")


def _config(args: argparse.Namespace, pp: int, schedule: str = "1f1b", device: str = "cpu") -> RunConfig:
    return RunConfig(
        inner=InnerConfig(batch_size=args.batch_size),
        parallel=ParallelConfig(
            pp=pp, microbatches=args.microbatches, schedule=schedule, device=device, precision="fp32"
        ),
    )


def _rank(rank: int, port: int, args: argparse.Namespace, schedule: str, out: str) -> None:
    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import SiteTrainer

    torch.set_num_threads(args.threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    config = _config(args, 2, schedule, device)
    mesh = SiteMesh(config.parallel, collective_timeout_s=600)
    try:
        trainer = SiteTrainer(config, load_corpus(None), mesh)
        trainer.train_steps(3)
        dist.barrier()
        _, tokens, seconds = trainer.train_steps(args.steps)
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{tokens / seconds} {mesh.compute.backend}")
    finally:
        mesh.close()


def run(args: argparse.Namespace, out_dir) -> str:
    torch.set_num_threads(args.threads)
    single = InnerTrainer(_config(args, 1), load_corpus(None))
    single.train_steps(3)
    _, tokens, seconds = single.train_steps(args.steps)
    rows = [{"pp": 1, "schedule": "-", "backend": "-", "tokens_per_s": round(tokens / seconds), "vs_pp1": 1.0}]
    for schedule in ("gpipe", "1f1b"):
        port = free_local_port()
        out = os.path.join(tempfile.mkdtemp(), "rate")
        mp.spawn(_rank, args=(port, args, schedule, out), nprocs=2, join=True)
        rate, backend = open(out).read().split()
        rows.append(
            {
                "pp": 2,
                "schedule": schedule,
                "backend": backend,
                "tokens_per_s": round(float(rate)),
                "vs_pp1": round(float(rate) / rows[0]["tokens_per_s"], 3),
            }
        )
    notes = (
        f"Default model, batch {args.batch_size}, {args.microbatches} micro-batches, {args.steps} timed inner steps, "
        f"{args.threads} torch thread(s) per process, {os.cpu_count()} CPU cores, "
        f"CUDA devices: {torch.cuda.device_count()}. PP=2 runs two ranks on the same machine, so on CPU it shows "
        "the pipeline's overhead and its use of a second core, not a speed-up from more hardware.\n"
    )
    return write_report(
        out_dir, "pipeline", "Pipeline throughput: PP=2 vs PP=1", rows, list(rows[0]), notes, {"args": vars(args)}
    )
