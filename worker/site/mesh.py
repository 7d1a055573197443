"""Where a rank sits inside its site, and the site's process groups: a pp × dp `DeviceMesh`.

A site is one `torchrun` job of pp × dp ranks, laid out as torchtitan lays out its meshes: the mesh
dimensions are ("pp", "dp_replicate", "dp_shard"), row-major, so rank = stage · dp + replica and
replica = r · dp_shard + s. The ranks of one stage (its dp ranks) share FSDP's mesh; the ranks of one
replica across stages form a pipeline. One backend for all of it — NCCL on GPUs, gloo on the CPU — and
one extra gloo group over the whole site for the asynchronous checkpoint writer, whose collectives run
on a background thread and must not interleave with the training's on the same communicator.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dilocox.common.config.run import ParallelConfig
from dilocox.common.config.waits import SHARD_WAIT_S, STEP_TIMEOUT_S, collective_timeout_for
from dilocox.worker.train.device import Compute, resolve_compute

log = structlog.get_logger()


@dataclass(frozen=True)
class SiteShape:
    """The pure arithmetic of a layout: which stage and replica a rank is, and who its peers are."""

    pp: int
    dp: int
    dp_replicate: int = 1

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def stage_of(self, rank: int) -> int:
        return rank // self.dp

    def replica_of(self, rank: int) -> int:
        """0 … dp − 1 within the stage; also which part of the site's data this rank's pipeline trains on."""
        return rank % self.dp

    def shard_coordinate(self, replica: int) -> int:
        """Which of the stage's dp_shard row chunks `replica` holds (FSDP's shard index)."""
        return replica % self.dp_shard

    def replicate_coordinate(self, replica: int) -> int:
        return replica // self.dp_shard

    def replica_with(self, replicate: int, shard: int) -> int:
        return replicate * self.dp_shard + shard

    def stage_ranks(self, stage: int) -> list[int]:
        """The dp ranks of `stage`, in replica order (so a rank's index in its stage group is its replica)."""
        return [stage * self.dp + d for d in range(self.dp)]

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [s * self.dp + replica for s in range(self.pp)]

    @classmethod
    def of(cls, parallel: ParallelConfig) -> SiteShape:
        return cls(parallel.pp, parallel.dp, parallel.dp_replicate)


def _timed_options(backend: str, timeout: datetime.timedelta) -> tuple[str, object]:
    """`init_device_mesh`'s backend override for one dimension: the site's backend with `timeout`."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


class SiteMesh:
    """This rank's process groups and device; created once per worker process, before the model."""

    def __init__(
        self,
        parallel: ParallelConfig,
        collective_timeout_s: float | None = None,
        _adopted: DeviceMesh | None = None,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        """`collective_timeout_s`: how long a rank waits in an agreement for the others (default
        `collective_timeout_for` a 1,800 s shard wait: 6,600 s). It must outlast one rank's exchange: while
        one rank waits for a shard, its peers wait for it in the next collective. The boundary's first
        collective after an exchange is always an agreement, made on a gloo group of its own
        (`agreement_group`), so the peers wait on the host; the checkpoint writer's gloo group waits as long.
        `step_timeout_s`: every training collective's group — the default group, the mesh's dimensions and
        the stage group; NCCL on GPUs — waits that long (default 600 s, torch's own NCCL default), so a hung
        all-gather surfaces in minutes, not after the exchange's hours."""
        if collective_timeout_s is None:
            collective_timeout_s = collective_timeout_for(SHARD_WAIT_S)
        self.shape = SiteShape.of(parallel)
        world = dist.get_world_size() if _adopted is not None else int(os.environ["WORLD_SIZE"])
        if world != self.shape.world_size:
            raise SystemExit(
                f"dilocox worker: torchrun started {world} processes but --pp {parallel.pp} × --dp "
                f"{parallel.dp} needs {self.shape.world_size}"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        self.compute: Compute = resolve_compute(parallel, local_rank, local_world)
        self.device = self.compute.device
        if self.compute.is_cuda:
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        step_timeout = datetime.timedelta(seconds=step_timeout_s)
        if _adopted is None:
            dist.init_process_group(
                backend=self.compute.backend,
                timeout=step_timeout,
                device_id=self.device if self.compute.is_cuda else None,
            )
        self.rank = dist.get_rank()
        self.stage = self.shape.stage_of(self.rank)
        self.replica = self.shape.replica_of(self.rank)
        names = ("pp", "dp_replicate", "dp_shard")
        options = _timed_options(self.compute.backend, step_timeout)  # torch's defaults otherwise: 10 min NCCL, 30 gloo
        self.mesh: DeviceMesh = init_device_mesh(
            self.device.type,
            (self.shape.pp, self.shape.dp_replicate, self.shape.dp_shard),
            mesh_dim_names=names,
            backend_override={n: options for n in names},
        )
        self.pp_group = self.mesh.get_group("pp")
        self.shard_group = self.mesh.get_group("dp_shard")  # the ranks that together hold one copy of the stage
        self.stage_group = self._stage_group(step_timeout)  # all dp ranks of this stage, group rank = replica
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=timeout)
        # The site's decisions (which round, rejoin, run over, tokens): small integers, on the host. Not the
        # checkpoint's group, which DCP's background writes use at the same time.
        self.agreement_group = dist.new_group(backend="gloo", timeout=timeout)
        self.collective_timeout_s = collective_timeout_s
        self.step_timeout_s = step_timeout_s
        structlog.contextvars.bind_contextvars(rank=self.rank, stage=self.stage, replica=self.replica)
        log.info(
            "rank_ready",
            backend=self.compute.backend,
            world=world,
            pp=self.shape.pp,
            dp=self.shape.dp,
            dp_replicate=self.shape.dp_replicate,
            device=str(self.device),
            precision=self.compute.precision,
        )

    def settle(self) -> None:
        """Wait, on the agreement group, for every rank to reach this point: before the first training
        collective after work whose length differs by rank (a rank reading 140 GB of weights), so that
        the wait is on the host with the long timeout, not in the step timeout of an NCCL collective."""
        dist.barrier(group=self.agreement_group)

    @classmethod
    def adopt(
        cls,
        device_mesh: DeviceMesh,
        parallel: ParallelConfig | None = None,
        collective_timeout_s: float | None = None,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ) -> SiteMesh:
        """The site of a job that owns its mesh (torchtitan's, accelerate's): the process group stays the
        job's, and its layout is read from `device_mesh` — dimensions "pp", "dp_replicate" and "dp_shard"
        (or "dp"), each optional, in that order, row-major over ranks 0 … world − 1, as torchtitan lays them
        out. Every other dimension must be of size 1: tensor or context parallelism splits a parameter
        across ranks in ways the exchange does not read (refused by name). DiLoCoX's own groups (the
        stage's, the agreements', the checkpoint writer's) are made over the same ranks, with
        `collective_timeout_s`. `parallel`: the rest of the layout's settings (microbatches, precision);
        its pp and dp are taken from the mesh; `step_timeout_s`: DiLoCoX's own training groups' (the job's
        process group keeps its own timeout)."""
        if not dist.is_initialized():
            raise ValueError("SiteMesh.adopt: the job's process group is not initialised; make the mesh first")
        names = tuple(device_mesh.mesh_dim_names or ())
        if not names:
            raise ValueError("SiteMesh.adopt: the mesh has no dimension names; name them pp, dp_replicate, dp_shard")
        sizes = dict(zip(names, device_mesh.mesh.shape))
        others = {name: size for name, size in sizes.items() if name not in ("pp", "dp_replicate", "dp_shard", "dp")}
        if any(size > 1 for size in others.values()):
            raise ValueError(
                f"SiteMesh.adopt: the mesh splits parameters over {others} (tensor or context parallel): "
                "DiLoCoX exchanges a stage sharded over its dp ranks only; give it a mesh of pp × dp"
            )
        known = [name for name in names if name in ("pp", "dp_replicate", "dp_shard", "dp")]
        order = {"pp": 0, "dp_replicate": 1, "dp_shard": 2, "dp": 2}
        if known != sorted(known, key=order.__getitem__) or ("dp" in sizes and "dp_shard" in sizes):
            raise ValueError(
                f"SiteMesh.adopt: dimensions {names}: expected pp, dp_replicate, dp_shard (each optional) in that order"
            )
        world = dist.get_world_size()
        if device_mesh.mesh.flatten().tolist() != list(range(world)):
            raise ValueError(
                f"SiteMesh.adopt: the mesh covers ranks {device_mesh.mesh.flatten().tolist()}, not 0 … {world - 1} "
                "row-major: a site is the whole job, laid out pp-major"
            )
        dp_replicate = sizes.get("dp_replicate", 1)
        dp = dp_replicate * sizes.get("dp_shard", sizes.get("dp", 1))
        base = parallel or ParallelConfig(device="cpu" if device_mesh.device_type == "cpu" else "cuda")
        layout = dataclasses.replace(base, pp=sizes.get("pp", 1), dp=dp, dp_replicate=dp_replicate)
        return cls(layout, collective_timeout_s, _adopted=device_mesh, step_timeout_s=step_timeout_s)

    def _stage_group(self, timeout: datetime.timedelta) -> dist.ProcessGroup:
        """One group per stage over its dp ranks; every rank creates every group, in the same order, as
        `new_group` requires."""
        mine = None
        for stage in range(self.shape.pp):
            group = dist.new_group(self.shape.stage_ranks(stage), timeout=timeout)
            if stage == self.stage:
                mine = group
        assert mine is not None
        return mine

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards a stage over: 1-D (dp_shard) for FSDP, 2-D (dp_replicate, dp_shard) for
        HSDP and plain replication; None for dp = 1 (nothing to shard or replicate)."""
        if self.shape.dp == 1:
            return None
        if self.shape.dp_replicate == 1:
            return self.mesh["dp_shard"]
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.shape.pp - 1

    def last_stage_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline."""
        return self.shape.pipeline_ranks(self.replica)[-1]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
