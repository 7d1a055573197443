"""`dilocox bench load` above the old limit: more concurrent long-polling pulls than the thread-pool
server had threads (32). There, every round waited out its pulls' whole wait and the pulls were refused
DEADLINE_EXCEEDED; parked on the event loop, every round closes with every cluster."""

from __future__ import annotations

import json
import subprocess
import sys


def test_more_pullers_than_threads_close_every_round(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "bench",
            "load",
            "--clusters",
            "48",
            "--rounds",
            "2",
            "--pull-wait-s",
            "20",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "load.json").read_text())["rows"]
    assert row["clusters"] == 48 and row["refused_calls"] == 0  # no pull ran out its wait, no round was dropped


def test_at_wan_pace_beside_stalled_pushes_every_round_closes_and_status_answers(tmp_path):
    """More pushes in transit at once than the old shard had threads (40 paced sites × 2 shards), beside 20
    stalled push streams: every timed round closes and every Status call is answered (the figures
    themselves are the benchmark's, in docs/performance.md)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "bench",
            "load",
            "--clusters",
            "40",
            "--rounds",
            "2",
            "--wan-mbit",
            "20",
            "--push-kb",
            "64",
            "--stalled",
            "10",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "load_wan.json").read_text())["rows"]
    assert row["sites"] == 40 and row["stalled_streams"] == 20 and row["status_calls"] > 0
    assert row["status_max_s"] != float("inf"), row  # no Status call failed or ran out its 30 s
    assert row["link_s"] > 0 and row["round_latency_max_s"] >= row["round_latency_median_s"] > 0


def test_pinned_each_shard_runs_on_a_core_of_its_own_and_the_sites_on_the_rest():
    """`--pin` puts a shard process's every thread, later ones included, on one core and the simulated sites on
    the others (read back from the kernel while the row runs); a machine without a core to spare refuses it."""
    import os
    import threading

    import pytest

    from dilocox.bench import load_wan

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("pinning needs 2 cores")
    seen: dict[str, set] = {}
    original = load_wan.pin_cores

    def cores_of_threads(pid: int | str) -> set[frozenset]:
        found = set()
        for thread in os.listdir(f"/proc/{pid}/task"):
            try:
                found.add(frozenset(os.sched_getaffinity(int(thread))))
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
        return found

    def pin_and_look(pids):  # noqa: ANN001, ANN202
        before = original(pids)  # the row then runs > 5 s (round 1 waits for the stalled site)
        threading.Timer(
            1.0, lambda: seen.update(shard=cores_of_threads(pids[0]), sites=cores_of_threads("self"))
        ).start()
        return before

    load_wan.pin_cores = pin_and_look
    try:
        row = load_wan.measure(sites=8, rounds=1, mbit=50, push_kb=16, stalled=2, shards=1, pin=True)
    finally:
        load_wan.pin_cores = original
    assert row["pinned"] and row["round_latency_median_s"] > 0
    assert seen["shard"] == {frozenset({cores[0]})}, seen  # threads the shard started after pinning too
    assert seen["sites"] == {frozenset(cores[1:])}, seen
    assert os.sched_getaffinity(0) == set(cores)  # given back after the row
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "bench",
            "load",
            "--wan-mbit",
            "10",
            "--shards",
            str(len(cores)),
            "--pin",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "--pin needs a core per shard and one for the sites" in refused.stderr
