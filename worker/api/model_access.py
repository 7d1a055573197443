"""How `DiLoCoX` reaches the user's model on this rank: the parameters the site exchanges, read and written
directly in one process (`LocalAccess`), or through the site's `SiteMesh` when the rank is one of a torchrun
site's (`SiteAccess`, FSDP2 shards or pipeline stages, the whole model's shapes gathered from every stage);
and the refusal of a job of several processes, or of a sharded model, that gave no mesh.

Kept apart from the `DiLoCoX` class (worker/api/site.py): what the user's model is to the exchange, and the
process checks that decide it, are one concern of their own, not the round loop's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dilocox.worker.exchange.access import LocalAccess, ParameterAccess

if TYPE_CHECKING:  # imported where a site of several ranks makes one
    from dilocox.worker.site.mesh import SiteMesh


def _refuse_processes_without_mesh(cluster: str) -> None:
    """A site of several processes must say how they split the model (a `SiteMesh`): without one every
    process would join as the same site with the whole model it holds — a DDP, accelerate, FSDP1 or ZeRO
    job's ranks would push the same slices several times, or flat-parameter views of them."""
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        how = "torch.distributed is initialised" if initialised else "WORLD_SIZE is set, as torchrun and accelerate do"
        raise ValueError(
            f"this process is one of {world} ({how}) but no mesh was given: each would join the run as site "
            f"{cluster!r} with the whole model it holds (DDP, accelerate, FSDP1 and ZeRO jobs look like this, "
            "and so does a Hugging Face Trainer launched over several processes). Give every rank of the site "
            "the same SiteMesh (docs/api.md, 'Under torchrun'; FSDP2 and pipeline stages), or run one process "
            "per site (the Trainer with DiLoCoXCallback: plain `python`, one GPU)"
        )


def _site_model_specs(mesh: SiteMesh, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...]]]:
    """The whole model's (name, full shape) over a site's pipeline stages, in stage order: each stage's
    own parameters (a DTensor's shape is the full one), gathered from every rank."""
    mine = (mesh.stage, [(n, tuple(p.shape)) for n, p in named])
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    specs: list[tuple[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for _stage, stage_specs in sorted(every, key=lambda item: item[0]):
        for name, shape in stage_specs:
            if name not in seen:
                seen.add(name)
                specs.append((name, shape))
    return specs


def access_for(model: torch.nn.Module, mesh: SiteMesh | None, cluster: str) -> ParameterAccess:
    """The parameters this rank exchanges: `model`'s own in one process (refused when the process is one
    of several, or the model sharded, without a `mesh`), or through `mesh` in a site of several ranks."""
    named = list(model.named_parameters())
    if mesh is None:
        _refuse_processes_without_mesh(cluster)
        if any(isinstance(p, DTensor) for _, p in named):
            raise ValueError("the model is sharded (DTensor parameters): pass the site's mesh (dilocox.SiteMesh)")
        return LocalAccess(named)
    from dilocox.worker.site.access import SiteAccess
    from dilocox.worker.site.parallelize import reshard_all

    def current() -> list[tuple[str, torch.nn.Parameter]]:
        reshard_all(model)  # an eval's forward leaves the root gathered: the exchange wants the shards
        return list(model.named_parameters())

    return SiteAccess(mesh, current, _site_model_specs(mesh, current()))
