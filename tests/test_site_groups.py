"""A site's process groups on real gloo ranks: the training collectives' groups time out after the step
timeout and the agreements' after the exchange's wait, and a decision each rank could take alone from its
own GPU (`--pipeline-reshard auto`) is taken from the site's smallest GPU, the same on every rank."""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.common.config.run import ParallelConfig
from tests.gloo_ranks import on_gloo_ranks


def _timeout_s(group) -> float:  # noqa: ANN001
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _groups(rank: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="4")
    from torch.distributed.device_mesh import init_device_mesh

    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import smallest_gpu

    job_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    mesh = SiteMesh.adopt(job_mesh, ParallelConfig(device="cpu"), collective_timeout_s=4321, step_timeout_s=123)
    smallest = smallest_gpu(mesh, [80, 40, 141, 94][rank] * 10**9)
    return {
        "pp": _timeout_s(mesh.pp_group),
        "shard": _timeout_s(mesh.shard_group),
        "stage": _timeout_s(mesh.stage_group),
        "agreement": _timeout_s(mesh.agreement_group),
        "checkpoint": _timeout_s(mesh.checkpoint_group),
        "smallest": smallest,
        "none": smallest_gpu(mesh, None),
    }


@pytest.mark.usefixtures("rank_forkserver")
def test_training_groups_time_out_after_a_step_and_agreements_after_the_exchange():
    for got in on_gloo_ranks(_groups, 4):
        assert got["pp"] == got["shard"] == got["stage"] == 123
        assert got["agreement"] == got["checkpoint"] == 4321
        assert got["smallest"] == 40 * 10**9 and got["none"] is None
