"""Shards at different versions converge without an operator: one of two shards
goes back to an older checkpoint mid-run (a kill -9 with checkpoints every few versions); the sites'
next pushes are for a round the other shard has closed, which refuses them; the sites keep that part
for the next round, rejoin at the older version, and the lagging shard catches up."""

from __future__ import annotations

import json
import subprocess
import sys

from dilocox.server.state import checkpoint
from tests.test_faults import finish, kill_all, wait_for

RUN = "converge-run"
ROUNDS = 14


def _site(address: str, index: int, log_path) -> subprocess.Popen:
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
        f"site-{index}",
        "--cluster-index",
        str(index),
        "--num-clusters",
        "2",
        "--rounds",
        str(ROUNDS),
        "--inner-steps",
        "3",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--inner-batch-size",
        "4",
        "--eval-batches",
        "1",
        "--threads",
        "1",
        "--log-format",
        "json",
        "--insecure",
    ]
    with open(log_path, "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def test_restart_shards_at_different_versions_converge(shard_set, tmp_path):
    shards = shard_set(2, RUN, min_clusters=2, added_latency_s=0.05)
    behind = shards.shards[1]
    saved: dict[int, dict] = {}
    behind.on_publish = lambda snapshot: saved.setdefault(snapshot.version, checkpoint.shard_state(behind))
    logs = [tmp_path / f"site-{i}.log" for i in range(2)]
    sites = [_site(",".join(shards.addresses), i, logs[i]) for i in range(2)]
    try:
        wait_for(lambda: behind.version >= 5, 180, "version 5")
        with behind._cond:  # "restarted" from its version-2 checkpoint: the open round and versions 3+ are gone
            checkpoint.restore(behind, saved[2])
            behind.accumulator = None
            behind._cond.notify_all()
        rewound_other = shards.shards[0].version
        assert rewound_other - behind.version >= 2
        finish(sites, logs)
    finally:
        kill_all(sites)
    assert shards.shards[0].version == behind.version == ROUNDS + 1  # converged, and the run ended normally
    events = [json.loads(line) for log in logs for line in log.read_text().splitlines() if line.startswith("{")]
    assert any(e["event"] == "pseudo_gradient_carried" for e in events)  # the refused part was kept, not lost
