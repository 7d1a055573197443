"""Faults with real processes: a cluster killed with SIGKILL mid-run, the run going on, the cluster coming back."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import structlog
import torch

RUN = "fault-run"
DEADLINE_S = 2.0
ROUNDS = 40


def worker(address: str, name: str, index: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "dilocox.common.cli", "worker", "--servers", address, "--run-id", RUN,
        "--cluster", name, "--cluster-index", str(index), "--num-clusters", "3", "--rounds", str(ROUNDS),
        "--inner-steps", "15", "--n-layer", "1", "--n-embd", "32", "--block-size", "32", "--inner-batch-size", "4",
        "--eval-batches", "1", "--threads", "1", "--log-format", "json", "--insecure",
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_killed_cluster_does_not_stall_the_run_and_rejoins(shard_set):
    """Issue 7, acceptance 1 (core): kill -9 one of 3 clusters; rounds go on past the deadline; it rejoins."""
    shards = shard_set(1, RUN, min_clusters=2, round_deadline_s=DEADLINE_S)
    shard = shards.shards[0]
    procs = {name: worker(shards.addresses[0], name, i) for i, name in enumerate(["a", "b", "c"])}
    restarted = None
    try:
        with structlog.testing.capture_logs() as logs:
            wait_for(lambda: shard.status()["clusters"] == ["a", "b", "c"], 120, "three clusters to join")
            all_in = shard.version
            wait_for(lambda: shard.version >= all_in + 2, 120, "two rounds with three clusters")
            procs["c"].send_signal(signal.SIGKILL)
            procs["c"].wait(timeout=10)
            killed_at_version = shard.version
            restarted = worker(shards.addresses[0], "c", 2)  # c comes back (its start-up takes a few seconds)

            # The run goes on with a and b: no round waits longer than the deadline (plus slack) for c.
            last, seen = time.monotonic(), shard.version
            while seen < killed_at_version + 3:
                time.sleep(0.05)
                if shard.version != seen:
                    last, seen = time.monotonic(), shard.version
                assert time.monotonic() - last < DEADLINE_S + 15, "a round stalled beyond its deadline"

            wait_for(lambda: "c" in shard.status()["clusters"], 60, "c to rejoin")
            rejoined_at = shard.version
            for name in ("a", "b"):
                assert procs[name].wait(timeout=120) == 0, procs[name].stderr.read()[-3000:]
            assert restarted.wait(timeout=120) == 0, restarted.stderr.read()[-3000:]
    finally:
        for p in [*procs.values(), restarted]:
            if p is not None and p.poll() is None:
                p.kill()
    assert shard.version == ROUNDS
    assert rejoined_at < ROUNDS  # c took part in the rounds after its return
    inactive = [e for e in logs if e["event"] == "cluster_inactive"]
    assert [e["cluster"] for e in inactive] == ["c"]  # dropped once, by the deadline, and only c
    closed_with = [e["clusters"] for e in logs if e["event"] == "round_closed"]
    assert 2 in closed_with and closed_with[-1] == 3  # rounds without c, then with c again
    assert all(torch.isfinite(t).all() for t in shard.snapshot.tensors.values())
