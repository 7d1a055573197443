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
