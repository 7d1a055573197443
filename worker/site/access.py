"""`ParameterAccess` for one rank of a site: the parameters it owns, moved in and out of FSDP's layout.

The rank owns a share of its stage's parameters (`reshard.owners_by_size`); reading gathers their rows
from the stage's ranks into the rank's host buffer, writing scatters them back, both on the device over
the stage's dp group. Decisions the whole site must take alike (which round, whether to rejoin) are one
small all-reduce over the site, on the host over the mesh's gloo agreement group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dilocox.worker.exchange.access import Land
from dilocox.worker.site.mesh import SiteMesh
from dilocox.worker.site.parallelize import local_part
from dilocox.worker.site.reshard import BATCH_ELEMENTS, Resharder, StageResharder


class SiteAccess:
    def __init__(
        self,
        mesh: SiteMesh,
        named_parameters: Callable[[], list[tuple[str, torch.nn.Parameter]]],
        model_specs: list[tuple[str, tuple[int, ...]]],
        batch_elements: int = BATCH_ELEMENTS,
    ) -> None:
        """`named_parameters`: the trainer's, called anew at every boundary (FSDP swaps the registered
        parameters between their sharded and gathered forms)."""
        self.named_parameters = named_parameters
        params = dict(named_parameters())
        self.mesh = mesh
        self.device = mesh.device
        self.model_specs = [(n, tuple(s)) for n, s in model_specs]
        sharded = mesh.fsdp_mesh is not None
        self.plan = StageResharder(
            {n: tuple(p.shape) for n, p in params.items()}, mesh.shape, mesh.replica, sharded, batch_elements
        )
        self.resharder = Resharder(self.plan, mesh.stage_group, mesh.device)
        self.resharder.check(self._local())
        self.names = list(self.plan.owned)
        self.shapes = {n: self.plan.shapes[n] for n in self.names}
        self.params_held = sum(local_part(p).numel() for p in params.values())
        self.pinned = mesh.compute.is_cuda

    def _local(self) -> dict[str, torch.Tensor]:
        """This rank's rows of each parameter, looked up anew each time (a checkpoint load may replace
        the tensors FSDP keeps them in)."""
        return {n: local_part(p).detach() for n, p in self.named_parameters()}

    def read(self, out: dict[str, torch.Tensor]) -> None:
        self.resharder.gather(self._local(), out)

    def read_rows(self, land: Land, keep_buffer: bool = True) -> None:
        self.resharder.gather_rows(self._local(), land, pinned=self.pinned, keep=keep_buffer)

    def write(self, values: dict[str, torch.Tensor]) -> None:
        self.resharder.scatter(self._local(), values)

    def _over_site(self, value: int, op: dist.ReduceOp) -> int:
        """On the mesh's gloo agreement group, on the host: a rank still in its exchange is waited for there,
        with the site's long timeout, not in an NCCL collective (SiteMesh)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.mesh.agreement_group)
        return int(t.item())

    def agree_min(self, value: int) -> int:
        return self._over_site(value, dist.ReduceOp.MIN)

    def agree_max(self, value: int) -> int:
        return self._over_site(value, dist.ReduceOp.MAX)

    def agree_any(self, flag: bool) -> bool:
        return bool(self._over_site(int(flag), dist.ReduceOp.MAX))
