"""`dilocox bench load` above the old limit: more concurrent long-polling pulls than the thread-pool
server had threads (32). There, every round waited out its pulls' whole wait and the pulls were refused
DEADLINE_EXCEEDED; parked on the event loop, every round closes with every cluster."""

from __future__ import annotations

import json
import subprocess
import sys


def test_more_pullers_than_threads_close_every_round(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dilocox.common.cli", "bench", "load", "--clusters", "48", "--rounds", "2",
                           "--pull-wait-s", "20", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "load.json").read_text())["rows"]
    assert row["clusters"] == 48 and row["refused_calls"] == 0  # no pull ran out its wait, no round was dropped


def test_at_wan_pace_beside_stalled_pushes_every_round_closes_and_status_answers(tmp_path):
    """More pushes in transit at once than the old shard had threads (40 paced sites × 2 shards), beside 20
    stalled push streams: every timed round closes and every Status call is answered (the figures
    themselves are the benchmark's, in docs/performance.md)."""
    done = subprocess.run([sys.executable, "-m", "dilocox.common.cli", "bench", "load", "--clusters", "40", "--rounds", "2",
                           "--wan-mbit", "20", "--push-kb", "64", "--stalled", "10", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "load_wan.json").read_text())["rows"]
    assert row["sites"] == 40 and row["stalled_streams"] == 20 and row["status_calls"] > 0
    assert row["status_max_s"] != float("inf"), row  # no Status call failed or ran out its 30 s
    assert row["link_s"] > 0 and row["round_latency_max_s"] >= row["round_latency_median_s"] > 0
