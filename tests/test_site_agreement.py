"""A site's ranks decide at the boundary on agreed values, never on what one rank saw.

Two real ranks on a gloo process group, each with its own view: the run is over for both when one rank's
shard has published the final version (else one would enter the checkpoint's barrier and the other the
reshard's all_to_all, and the site would hang); the end-of-run flush is skipped by both or neither; and a
rank passing tokens that differ from the others' is refused, on every rank, by name. And a multi-process
job that gives no mesh is refused by name before anything joins.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from dilocox.worker.exchange.aggregator_client import Traffic
from dilocox.worker.exchange.cluster import DilocoCluster
from tests.gloo_ranks import on_gloo_ranks


class GlooAgreement:
    """The site's agreement as `SiteAccess` makes it (one all-reduce over the site), on the CPU."""

    def _over_site(self, value: int, op: dist.ReduceOp) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def agree_min(self, value: int) -> int:
        return self._over_site(value, dist.ReduceOp.MIN)

    def agree_max(self, value: int) -> int:
        return self._over_site(value, dist.ReduceOp.MAX)

    def agree_any(self, flag: bool) -> bool:
        return bool(self._over_site(int(flag), dist.ReduceOp.MAX))


def _rank(rank: int) -> tuple:
    site = types.SimpleNamespace(
        access=GlooAgreement(), final_version=5, client=types.SimpleNamespace(cluster="c", traffic=Traffic())
    )
    # Rank 1's shard published the final version 5; rank 0's still answers 4.
    over = DilocoCluster._run_over_without(site, 5, 1000, 5 if rank == 1 else 4)
    not_over = DilocoCluster._run_over_without(site, 4, 1000, 3 if rank == 1 else 4)
    refused = ""
    try:
        DilocoCluster._check_tokens_agree(site, 3, 1000 + rank)  # rank 1 passes its own share
    except ValueError as error:
        refused = str(error)
    DilocoCluster._check_tokens_agree(site, 3, 2000)  # the same number on both: taken
    return rank, over, not_over, site.client.traffic.dropped_rounds, refused


@pytest.mark.usefixtures("rank_forkserver")
def test_a_sites_ranks_decide_the_run_over_and_refuse_unequal_tokens_alike():
    results = on_gloo_ranks(_rank, 2)
    assert [r[1] for r in results] == [True, True] and [r[2] for r in results] == [False, False]
    assert [r[3] for r in results] == [1, 1]  # each rank counts the round it could not deliver
    assert all("different tokens (1000 to 1001)" in r[4] for r in results), results


def _without_mesh(rank: int) -> str:
    from dilocox import DiLoCoX

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))  # a DDP job's model
    try:
        DiLoCoX(model, servers="127.0.0.1:1")
        return ""
    except ValueError as error:
        return str(error)


@pytest.mark.usefixtures("rank_forkserver")
def test_a_multi_process_job_without_a_mesh_is_refused_by_name(monkeypatch):
    """DDP (and accelerate, FSDP1, ZeRO) ranks would each join as the same site."""
    results = on_gloo_ranks(_without_mesh, 2)
    assert all(
        "one of 2 (torch.distributed is initialised) but no mesh was given" in why and "SiteMesh" in why
        for why in results
    ), results
    from dilocox import DiLoCoX

    monkeypatch.setenv("WORLD_SIZE", "4")  # launched by torchrun or accelerate, no process group yet
    with pytest.raises(ValueError, match="WORLD_SIZE is set"):
        DiLoCoX(torch.nn.Linear(4, 4), servers="127.0.0.1:1")


def test_the_sites_collective_timeout_outlasts_the_longest_legitimate_exchange_wait():
    """One rank may wait PULL_WAIT_S for a round's result plus --shard-wait-s for a shard
    that is down; its peers wait for it in the next agreement (gloo, on the host) with this timeout. It was
    --shard-wait-s + 600 = 2,400 s by default, shorter than the pull wait alone. One call's own limit in
    flight at the exchange's end counts too (tests/test_shard_wait.py: no wait goes past that end)."""
    from dilocox.common.config.waits import PULL_WAIT_S, RPC_TIMEOUT_S, collective_timeout_for
    from dilocox.worker.exchange.communicator import Communicator

    assert collective_timeout_for(1800) == 6600 > PULL_WAIT_S + 1800 + RPC_TIMEOUT_S > 2400
    assert all(collective_timeout_for(w) > PULL_WAIT_S + w for w in (0, 60, 1800, 7200))
    assert Communicator.__init__.__defaults__[1] == PULL_WAIT_S  # the communicator waits what the model says
    with pytest.raises(ValueError, match="waits must be positive"):
        collective_timeout_for(-1)
    # A site sets all three waits; the timeout follows them, and each flag's bad value is refused by name.
    assert collective_timeout_for(60, pull_wait_s=300, margin_s=30) == 390 + RPC_TIMEOUT_S
    import subprocess
    import sys

    worker = [sys.executable, "-m", "dilocox.common.cli", "worker", "--servers", "127.0.0.1:1", "--insecure"]
    for flag, value in (("--pull-wait-s", "0"), ("--boundary-margin-s", "-5"), ("--shard-wait-s", "-1")):
        refused = subprocess.run([*worker, flag, value], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and f"dilocox worker: {flag} must be" in refused.stderr, refused.stderr[-500:]


def test_shard_settings_that_break_the_order_of_the_waits_are_refused_by_name(tmp_path):
    """A round deadline longer than a site's pull wait, or a grace window not shorter
    than the deadline, is refused by `dilocox server` and by `dilocox config show --command server`."""
    import subprocess
    import sys

    from dilocox.common.config.waits import PULL_WAIT_S, contradictions

    assert contradictions(300.0, 30.0) == [] and contradictions(0.0, 30.0) == [] and contradictions(None) == []
    assert "--round-deadline-s 7200" in contradictions(7200.0)[0] and f"{PULL_WAIT_S:g}" in contradictions(7200.0)[0]
    assert "--grace-s 90" in contradictions(60.0, 90.0)[0]
    cli = [sys.executable, "-m", "dilocox.common.cli"]
    server = subprocess.run(
        [*cli, "server", "--insecure", "--port", "0", "--round-deadline-s", "7200"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert server.returncode != 0 and "--round-deadline-s 7200 is longer" in server.stderr
    config = tmp_path / "run.toml"
    config.write_text("[server]\nround-deadline-s = 60\ngrace-s = 90\n")
    shown = subprocess.run(
        [*cli, "config", "show", "--command", "server", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 1 and "--grace-s 90 is not shorter than --round-deadline-s 60" in shown.stderr


def _adopt(rank: int, dims: tuple, names: tuple) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    from dilocox.worker.site.mesh import SiteMesh

    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    try:
        site = SiteMesh.adopt(mesh)
    except ValueError as error:
        return ("refused", str(error))
    agreed = site.agreement_group is not None and torch.distributed.get_world_size(site.stage_group)
    return (site.shape.pp, site.shape.dp, site.shape.dp_replicate, site.stage, site.replica, agreed)


@pytest.mark.usefixtures("rank_forkserver")
def test_a_jobs_own_device_mesh_is_adopted_and_tensor_parallel_refused_by_name():
    """A job that made its process group and mesh (torchtitan's dimension names)
    gives it to DiLoCoX as it is; a mesh that splits parameters over tp is refused, naming it."""
    assert on_gloo_ranks(_adopt, 2, (2,), ("dp_shard",)) == [(1, 2, 1, 0, 0, 2), (1, 2, 1, 0, 1, 2)]
    assert on_gloo_ranks(_adopt, 2, (2, 1), ("pp", "dp_shard")) == [(2, 1, 1, 0, 0, 1), (2, 1, 1, 1, 0, 1)]
    refused = on_gloo_ranks(_adopt, 2, (1, 2), ("dp_shard", "tp"))
    assert all(r[0] == "refused" and "{'tp': 2}" in r[1] for r in refused), refused


def _api_with_device_mesh(rank: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dilocox import DiLoCoX

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))  # the job's own, as torchtitan makes it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(model, mesh=mesh)
    site = DiLoCoX(model, servers="127.0.0.1:1", mesh=mesh)  # nothing is contacted before start
    try:
        return type(site.mesh).__name__, site.mesh.shape.dp, sorted(site.access.names)
    finally:
        site.close()


@pytest.mark.usefixtures("rank_forkserver")
def test_the_api_takes_the_jobs_device_mesh():
    results = on_gloo_ranks(_api_with_device_mesh, 2)
    assert [r[:2] for r in results] == [("SiteMesh", 2), ("SiteMesh", 2)]
    owned = [set(r[2]) for r in results]  # each parameter exchanged by exactly one rank of the site
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == {"0.weight", "0.bias", "1.weight", "1.bias"}
