"""Where a rank sits inside its cluster: pipeline stage × data-parallel replica, and its process groups.

Ranks are laid out stage-major: rank = stage · dp + replica. The pipeline group of replica d holds
the ranks {s · dp + d}; the data-parallel group of stage s holds {s · dp + d}. Every rank creates every
group in the same order, as `torch.distributed.new_group` requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    rank: int
    pp: int
    dp: int

    @property
    def stage(self) -> int:
        return self.rank // self.dp

    @property
    def replica(self) -> int:
        return self.rank % self.dp

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        d = self.replica if replica is None else replica
        return [s * self.dp + d for s in range(self.pp)]

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        s = self.stage if stage is None else stage
        return [s * self.dp + d for d in range(self.dp)]

    def replica_of(self, sizes: dict[str, int]) -> dict[str, int]:
        """Which replica of the stage pushes and pulls each parameter: balanced by element count
        (largest first onto the least-loaded replica), the same on every rank."""
        loads = [0] * self.dp
        owner = {}
        for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
            replica = min(range(self.dp), key=lambda d: (loads[d], d))
            owner[name] = replica
            loads[replica] += sizes[name]
        return owner

    def share(self, sizes: dict[str, int]) -> list[str]:
        """This replica's share of its stage's parameters (in the stage's order)."""
        owner = self.replica_of(sizes)
        return [n for n in sizes if owner[n] == self.replica]

    def owner_rank(self, sizes: dict[str, int], name: str) -> int:
        """Global rank of the replica that pushes and pulls `name`."""
        return self.replica_ranks()[self.replica_of(sizes)[name]]


def new_groups(layout: ParallelLayout) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(pipeline group of this rank, data-parallel group of this rank)."""
    pipeline_group = replica_group = None
    for d in range(layout.dp):
        group = dist.new_group(layout.pipeline_ranks(d))
        if d == layout.replica:
            pipeline_group = group
    for s in range(layout.pp):
        group = dist.new_group(layout.replica_ranks(s))
        if s == layout.stage:
            replica_group = group
    assert pipeline_group is not None and replica_group is not None
    return pipeline_group, replica_group
