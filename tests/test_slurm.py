"""`dilocox deploy slurm` for real: a single-node Slurm (Debian's slurm-wlm, started by the test) runs
the rendered sbatch scripts — 2 shards and 2 CPU sites, one a 2-rank pipeline under torchrun — to the
run's end, and a site requeued mid-run (`scontrol requeue`) resumes from its checkpoint.

Skipped, with the reason, where Slurm cannot be installed or started (not root, no apt-get)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest

from dilocox.common.deploy.deploy_cli import parse_sites
from dilocox.common.deploy.slurm import SlurmOptions, site_script
from dilocox.common.deploy.topology import Topology
from tests.json_logs import json_events
from tests.local_slurm import LocalSlurm
from tests.ports import free_port_range

ROUNDS = 6  # rounds take ~0.4 s here: enough left after the requeue point that the site is still running


def _wait(condition, timeout: float, what: str, slurm: LocalSlurm, out: pathlib.Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(out.glob("*.out")))
    raise AssertionError(f"{what} within {timeout:g}s; squeue:\n{slurm.run('squeue', check=False).stdout}\n{logs}")


def test_sbatch_scripts_run_shards_and_sites_to_the_end_and_a_requeued_site_resumes(slurm, tmp_path):
    out = tmp_path / "jobs"
    rendered = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "deploy",
            "slurm",
            "--out",
            str(out),
            "--run-id",
            "slurm-test",
            "--shards",
            "2",
            "--sites",
            "site-a:1x1,site-b:2x1",
            "--rounds",
            str(ROUNDS),
            "--inner-steps",
            "8",
            "--gpus-per-node",
            "0",
            "--cpus-per-rank",
            "1",
            "--insecure",
            "--shard-port",
            str(free_port_range(2)),
            "--metrics-port",
            str(free_port_range(4)),
            "--rdzv-port",
            str(free_port_range(2)),
            "--state-dir",
            str(tmp_path / "state"),
            "--setup",
            f"export PATH={pathlib.Path(sys.executable).parent}:$PATH",
            "--worker-flags",
            "--device cpu --eval-batches 2 --n-layer 2 --n-embd 64 --block-size 64 --inner-batch-size 8 --threads 1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rendered.returncode == 0, rendered.stderr
    assert sorted(p.name for p in out.iterdir()) == ["shards.sbatch", "site-site-a.sbatch", "site-site-b.sbatch"]
    assert "sbatch --dependency=after:$shards" in rendered.stdout

    shards = slurm.sbatch(out / "shards.sbatch")
    sites = {
        name: slurm.sbatch(out / f"site-{name}.sbatch", f"--dependency=after:{shards}") for name in ("site-a", "site-b")
    }
    b_log = out / f"slurm-test-site-b-{sites['site-b']}.out"

    def b_made(rounds: int) -> bool:
        return sum(1 for e in json_events(b_log) if e.get("event") == "round_done") >= rounds

    def b_committed() -> bool:  # a checkpoint is committed once its round is on the shards, sealed in the background
        return any(e.get("event") == "worker_checkpoint_saved" for e in json_events(b_log))

    _wait(lambda: b_made(2) and b_committed(), 240, "site-b made 2 rounds and committed a checkpoint", slurm, out)
    slurm.run("scontrol", "requeue", sites["site-b"])  # Slurm stops it and starts the same script again
    jobs = [shards, *sites.values()]
    _wait(
        lambda: all(slurm.state(j) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "") for j in jobs),
        300,
        "every job ended",
        slurm,
        out,
    )
    states = {j: slurm.state(j) for j in jobs}
    assert set(states.values()) == {"COMPLETED"}, states

    # site-b ran twice (same job, appended log) and the second start resumed from its checkpoint.
    text = b_log.read_text()
    assert "site site-b job" in text and " start 2 " in text, text[-2000:]
    resumed = [e for e in json_events(b_log) if e.get("event") == "resume_if_present"]
    assert [e["resume"] for e in resumed][:1] == [False] and True in [e["resume"] for e in resumed], resumed
    for name, job in sites.items():
        events = json_events(out / f"slurm-test-{name}-{job}.out")
        done = [e for e in events if e.get("event") == "cluster_done"]
        assert done, f"{name} did not finish"
        assert max(e["round"] for e in events if e.get("event") == "round_done") == ROUNDS
    # Both shards ran to the run's end (they stop by themselves once every site has the final version).
    shard_events = json_events(out / f"slurm-test-shards-{shards}.out")
    finished = [e for e in shard_events if e.get("event") == "run_finished"]
    # The final version is rounds + 1: with the one-step delay the sites flush their last round's work.
    assert sorted(e["shard"] for e in finished) == [0, 1] and all(e["version"] == ROUNDS + 1 for e in finished), (
        finished
    )


def test_a_multi_node_site_runs_one_torchrun_per_node_with_the_rendezvous_on_the_first():
    """Rendering only (one node here): a 2×4 site on 4-GPU nodes is 2 nodes of 4 ranks."""
    topology = Topology(run_id="big", sites=parse_sites("hpc:2x4"), num_shards=2)
    options = SlurmOptions(gpus_per_node=4, servers="agg0.example:50051,agg1.example:50051", tls_dir="/shared/tls")
    script = site_script(topology, 0, options)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=4" in script and "#SBATCH --requeue" in script
    assert "--nnodes=2" in script and "--nproc-per-node=4" in script and '--node-rank="$SLURM_NODEID"' in script
    assert 'DILOCOX_SERVERS="agg0.example:50051,agg1.example:50051"' in script and "addresses" not in script
    assert "--tls-ca /shared/tls/ca.pem" in script and "--insecure" not in script and "--resume-if-present" in script
    with pytest.raises(SystemExit, match="ranks per node"):
        site_script(Topology(sites=parse_sites("odd:3x1")), 0, SlurmOptions(gpus_per_node=2))


def test_every_rendered_site_gives_torchrun_the_stop_timeout():
    """The 30 s torchrun gives by default killed a stopping site; rendered scripts export the project's
    (an operator's own TORCH_ELASTIC_SHUTDOWN_TIMEOUT wins)."""
    from dilocox.common.config.waits import SHUTDOWN_TIMEOUT_ENV, STOP_TIMEOUT_S
    from dilocox.common.deploy.topology import Site

    script = site_script(
        Topology(run_id="r", sites=(Site("a", 2, 1),), simulation=False), 0, SlurmOptions(servers="agg:50051")
    )
    assert f"export {SHUTDOWN_TIMEOUT_ENV}=${{{SHUTDOWN_TIMEOUT_ENV}:-{STOP_TIMEOUT_S}}}" in script
