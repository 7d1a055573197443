"""Faults with real processes: a cluster killed with SIGKILL mid-run, the run going on, the cluster
coming back, and the result compared with the same run without the fault (run beside it: both runs
are bound by the added latency, not the CPU)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import structlog
import torch

from dilocox.common.subprocesses import stop_gracefully

RUN = "fault-run"
DEADLINE_S = 2.0
ROUNDS = 50
LATENCY_S = 0.2  # every push and pull: rounds last long enough for a restarted worker to come back in time
CLUSTERS = ["a", "b", "c"]


def worker(address: str, name: str, index: int, log_path: pathlib.Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "worker",
        "--servers",
        address,
        "--run-id",
        RUN,
        "--cluster",
        name,
        "--cluster-index",
        str(index),
        "--num-clusters",
        "3",
        "--rounds",
        str(ROUNDS),
        "--inner-steps",
        "15",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--inner-batch-size",
        "4",
        "--eval-batches",
        "4",
        "--threads",
        "1",
        "--log-format",
        "json",
        "--insecure",
    ]
    with open(log_path, "a") as log:  # a file, not a pipe: a full pipe would block the worker
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def final_eval_loss(log_path: pathlib.Path) -> float:
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    (done,) = [e for e in events if e["event"] == "cluster_done"]
    return done["final_eval_loss"]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def finish(procs: list[subprocess.Popen], logs: list[pathlib.Path]) -> None:
    for proc, log in zip(procs, logs):
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]


def baseline_shard(tmp_path: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """The no-fault run's shard, with the fault run's settings (ShardSet's outer optimiser included), as a
    `dilocox server` process: it runs while the fault run's events are captured, and an in-process shard's
    events would land in that capture too (they carry nothing that tells the two shards apart)."""
    port_file = tmp_path / "nofault-shard.port"
    argv = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--run-id",
        RUN,
        "--min-clusters",
        "2",
        "--round-deadline-s",
        str(DEADLINE_S),
        "--added-latency-ms",
        str(round(LATENCY_S * 1000)),
        "--outer-lr",
        "0.7",
        "--outer-momentum",
        "0.9",
        "--keep-serving",
        "--log-format",
        "json",
        "--insecure",
    ]
    with open(tmp_path / "nofault-shard.log", "w") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )  # one torch thread, as each worker has (--threads 1): six processes beside it share the cores
    try:
        wait_for(lambda: port_file.exists() or proc.poll() is not None, 120, "the no-fault shard to listen")
        assert proc.poll() is None, (tmp_path / "nofault-shard.log").read_text()[-3000:]
    except BaseException:
        stop_gracefully(proc, grace_s=10)
        raise
    return proc, f"127.0.0.1:{port_file.read_text()}"


def kill_all(procs) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()


def test_killed_cluster_does_not_stall_the_run_and_rejoins(shard_set, tmp_path):
    """Kill -9 one of 3 clusters; rounds go on past the deadline without it; it
    restarts and rejoins; the final model is finite and its eval loss close to a run without the fault."""
    baseline, baseline_address = baseline_shard(tmp_path)
    nofault_logs = {name: tmp_path / f"nofault-{name}.log" for name in CLUSTERS}
    nofault = [worker(baseline_address, name, i, nofault_logs[name]) for i, name in enumerate(CLUSTERS)]
    procs, restarted = {}, None
    try:
        shards = shard_set(1, RUN, min_clusters=2, round_deadline_s=DEADLINE_S, added_latency_s=LATENCY_S)
        shard = shards.shards[0]
        logs = {name: tmp_path / f"fault-{name}.log" for name in CLUSTERS}
        procs = {name: worker(shards.addresses[0], name, i, logs[name]) for i, name in enumerate(CLUSTERS)}
        with structlog.testing.capture_logs() as events:
            wait_for(lambda: shard.status()["clusters"] == CLUSTERS, 120, "three clusters to join")
            all_in = shard.version
            wait_for(lambda: shard.version >= all_in + 2, 120, "two rounds with three clusters")
            procs["c"].send_signal(signal.SIGKILL)
            procs["c"].wait(timeout=10)
            killed_at_version = shard.version

            # The run goes on with a and b: no round waits longer than the deadline (plus slack) for c.
            last, seen = time.monotonic(), shard.version
            while seen < killed_at_version + 3:
                time.sleep(0.05)
                if shard.version != seen:
                    last, seen = time.monotonic(), shard.version
                assert time.monotonic() - last < DEADLINE_S + 15, "a round stalled beyond its deadline"

            restarted = worker(shards.addresses[0], "c", 2, logs["c"])  # c comes back
            wait_for(lambda: "c" in shard.status()["clusters"], 60, "c to rejoin")
            rejoined_at = shard.version
            finish([procs["a"], procs["b"], restarted], [logs["a"], logs["b"], logs["c"]])
        finish(nofault, list(nofault_logs.values()))
    finally:
        kill_all([*nofault, *procs.values(), restarted])
        stop_gracefully(baseline, grace_s=20)
    no_fault_loss = final_eval_loss(nofault_logs["a"])
    assert shard.version == ROUNDS + 1  # the rounds, then the end-of-run flush of the residuals
    assert rejoined_at < ROUNDS  # c took part in the rounds after its return
    inactive = [e for e in events if e["event"] == "cluster_inactive"]
    assert [e["cluster"] for e in inactive] == ["c"]  # dropped once, by the deadline, and only c
    closed_with = [e["clusters"] for e in events if e["event"] == "round_closed"]
    assert 2 in closed_with and closed_with[-1] == 3  # rounds without c, then with c again
    assert all(torch.isfinite(t).all() for t in shard.snapshot.tensors.values())
    fault_loss = final_eval_loss(logs["a"])
    assert abs(fault_loss - no_fault_loss) / no_fault_loss < 0.1, (fault_loss, no_fault_loss)
    print(f"eval loss with a killed cluster {fault_loss:.4f}, without {no_fault_loss:.4f}")
