"""One rank of a pipeline-parallel cluster: process groups, its stage, its share of the sync.

A cluster with pp × dp > 1 is a `torchrun` job (`dilocox worker --pp P --dp D` starts one itself when
not already under torchrun). Every rank trains its stage, pushes the pseudo-gradient of its replica's
share of the stage's parameters straight to the owning shards (parallel streams, no funnel rank), pulls
the same share back, and broadcasts it to the stage's other replicas over the in-site backend (NCCL on
GPU, gloo on CPU).
"""

from __future__ import annotations

import datetime
import os
import sys

import structlog
import torch
import torch.distributed as dist

from dilocox.common.config.run import RunConfig
from dilocox.worker.data.token_data import TokenData
from dilocox.worker.train.device import resolve_compute
from dilocox.worker.train.parallel_layout import ParallelLayout, new_groups
from dilocox.worker.train.pipeline_trainer import PipelineTrainer

log = structlog.get_logger()


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_with_torchrun(world_size: int) -> None:
    """Replace this process with a standalone torchrun job of `world_size` copies of the same command."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "-m", "dilocox.common.cli", *sys.argv[1:]]  # fmt: skip
    os.execv(sys.executable, argv)


def stage_sizes(trainer: PipelineTrainer) -> dict[str, int]:
    return {name: p.numel() for name, p in trainer.named_parameters()}


class DistributedContext:
    """Process groups and the layout of this rank; created once per worker process."""

    def __init__(self, config: RunConfig, collective_timeout_s: float = 2400.0) -> None:
        """`collective_timeout_s`: how long a rank waits in a collective for the others. It must outlast
        a shard outage (`--shard-wait-s`): while one rank waits for a shard, its pipeline peers wait for
        it in the next collective, and torch's default (30 min) would end the site first."""
        world = int(os.environ["WORLD_SIZE"])
        if world != config.parallel.world_size:
            raise SystemExit(
                f"dilocox worker: torchrun started {world} processes but --pp {config.parallel.pp} × --dp "
                f"{config.parallel.dp} needs {config.parallel.world_size}"
            )
        self.compute = resolve_compute(config.parallel, int(os.environ.get("LOCAL_RANK", "0")))
        self.device = self.compute.device
        backend = self.compute.backend
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=collective_timeout_s))
        self.layout = ParallelLayout(dist.get_rank(), config.parallel.pp, config.parallel.dp)
        self.pipeline_group, self.replica_group = new_groups(self.layout)
        structlog.contextvars.bind_contextvars(rank=self.layout.rank, stage=self.layout.stage, replica=self.layout.replica)
        log.info("rank_ready", backend=backend, world=world, pp=self.layout.pp, dp=self.layout.dp, device=str(self.device),
                 precision=self.compute.precision)  # fmt: skip

    def trainer(self, config: RunConfig, data: TokenData, cluster_index: int, num_clusters: int) -> PipelineTrainer:
        return PipelineTrainer(config, data, self.layout, self.pipeline_group, self.replica_group,
                               cluster_index, num_clusters, self.compute)  # fmt: skip

    def peer_sync(self, trainer: PipelineTrainer):
        """Complete a rank's share of its stage's global weights with the replicas' shares (broadcasts
        in parameter order, each from the replica that pulled it)."""
        layout, group = self.layout, self.replica_group
        shapes = {name: tuple(p.shape) for name, p in trainer.named_parameters()}
        sizes = stage_sizes(trainer)
        owners = {name: layout.owner_rank(sizes, name) for name in sizes}

        def sync(partial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if layout.dp == 1:
                return partial
            full = {}
            for name, owner in owners.items():
                mine = owner == layout.rank
                tensor = partial[name].to(self.device) if mine else torch.empty(shapes[name], device=self.device)
                dist.broadcast(tensor, src=owner, group=group)
                full[name] = tensor.cpu()
            return full

        return sync

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
