"""A site stopped (SIGSTOP) for many times its time box in the middle of its inner steps:
when it continues, the clock ends that round at once — not the H estimated before the stall — its late
work enters weighed by its age, and the run ends close to the same run without the stall.

Real processes: `dilocox sim` (two shards, two sites on a quorum of one with a grace window, time-boxed
rounds) and SIGSTOP/SIGCONT of one site's worker process."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

BOX_S = 1.5
STALL_S = 5 * BOX_S
FLAGS = [
    "--rounds",
    "10",
    "--inner-steps",
    "20",
    "--inner-max-steps",
    "2000",
    "--inner-round-time-s",
    str(BOX_S),
    "--inner-min-steps",
    "2",
    "--grace-s",
    "1",
    "--n-layer",
    "1",
    "--n-embd",
    "64",
    "--inner-batch-size",
    "8",
    "--timeout",
    "300",
    "--log-format",
    "json",
    "--no-tensorboard",
]


def _events(path: pathlib.Path, event: str) -> list[dict]:
    if not path.exists():
        return []
    return [
        e
        for e in (json.loads(line) for line in path.read_text().splitlines() if line.startswith("{"))
        if e["event"] == event
    ]


def _worker_pid(sim_pid: int, cluster: str) -> int | None:
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == sim_pid and b"worker" in argv and cluster.encode() in argv:
            return int(entry.name)
    return None


def _sim(tmp_path: pathlib.Path, stall: bool) -> tuple[dict, pathlib.Path]:
    logs = tmp_path / "logs"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "sim",
        *FLAGS,
        "--log-dir",
        str(logs),
        "--summary-json",
        str(tmp_path / "summary.json"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if stall:
            deadline = time.monotonic() + 180
            while not any(e["round"] == 2 for e in _events(logs / "cluster-1.log", "round_done")):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
                time.sleep(0.02)
            time.sleep(0.3 * BOX_S)  # into round 3's inner steps
            pid = _worker_pid(proc.pid, "cluster-1")
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STALL_S)
            os.kill(pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return json.loads((tmp_path / "summary.json").read_text()), logs


def test_a_stalled_site_ends_its_round_at_its_box_and_its_late_work_is_weighed_by_age(tmp_path):
    steady, _ = _sim(tmp_path / "steady", stall=False)
    stalled, logs = _sim(tmp_path / "stalled", stall=True)
    rounds = {e["round"]: e for e in _events(logs / "cluster-1.log", "round_done")}
    caught_up = _events(logs / "cluster-1.log", "round_caught_up")
    # Round 3's report carries the round its work was pushed to: 3, or a later one when the shards closed
    # the rounds in between without the site (how many depends on the machine's pace during the stall).
    stalled_round = next((e["pushed"] for e in caught_up if e["trained"] == 3), 3)
    normal = [e["inner_steps"] for r, e in rounds.items() if r not in (1, stalled_round)]
    # Round 3 was stopped some way into its box, for five boxes: it ends when it continues, with the steps it
    # had made — never more than an unstalled round (the old estimate-driven box trained a whole round's H
    # after the stall, on top). How far in the stop lands, and so how many steps, is the machine's pace: a
    # bound at 0.75 × the median round failed on a loaded machine (32 against 29).
    stopped = rounds[stalled_round]
    assert stopped["seconds"] >= STALL_S and stopped["inner_steps"] <= max(normal), (stopped, normal)
    # Its work reached the shards late, weighed by its age: pushed to a later round with its staleness
    # declared and tokens × 1/(1 + staleness), or carried one round and halved, and never above the
    # on-time site's tokens on a shard.
    for e in caught_up:
        assert (
            e["staleness"] == e["pushed"] - e["trained"] >= 1
            and e["weight"] <= e["tokens"] / (1 + e["staleness"]) + 1e-3
        )
    for shard in (0, 1):
        for e in _events(logs / f"shard-{shard}.log", "stale_contribution_capped"):
            assert e["weight"] <= e["tokens"]
    # An exchange that came back late (its round closed without the site) makes the next box shorter, to get
    # back in phase; work caught up straight into the open round is in phase already. Which of the two a
    # stall meets, and when the site is on time again, depend on the machine's load.
    late = [r for r, e in rounds.items() if e["late"] and r < max(rounds)]
    catching_up = {e["round"] for e in _events(logs / "cluster-1.log", "time_box_catching_up")}
    assert late or caught_up, rounds  # the stall showed, one way or the other
    assert all(any(c > r for c in catching_up) for r in late), (late, catching_up)  # a shorter box after each
    # The global model ends close to the unstalled run's, although the stall cost the stalled site's tokens
    # (~20 % of the run's): stale work did not set it back. Measured +2.0 % (2.251 against 2.206; 1.86M
    # against 2.31M tokens); the bound leaves room for a loaded machine's timing.
    assert stalled["ok"] and steady["ok"]
    assert stalled["global_eval_loss"] <= 1.10 * steady["global_eval_loss"], (stalled, steady)
