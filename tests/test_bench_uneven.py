"""`dilocox bench uneven --quick`: real shard and worker processes, one site 4× slower, all three modes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(1200)  # a hang guard: about 4 min on 2 idle cores, 2-3 times that beside a CPU burner
def test_bench_uneven_quick_runs_every_mode_and_reports_them(tmp_path):
    out = tmp_path / "uneven"
    done = subprocess.run(
        [sys.executable, "-m", "dilocox.common.cli", "bench", "uneven", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "uneven.json").read_text())["rows"]
    # --quick runs even sites for fixed only (the time box's budget): no assertion reads the other even rows
    assert {(r["slowdown"], r["mode"]) for r in rows} == {(1.0, "fixed")} | {
        (4.0, m) for m in ("fixed", "timebox", "quorum")
    }
    for row in rows:
        assert row["tokens"] > 0 and row["wall_s"] > 0 and 0 <= row["fast_idle_share"] <= 1, row
        assert row["final_eval_loss"] == row["final_eval_loss"], row  # every run ended with an evaluated model
    by = {(r["slowdown"], r["mode"]): r for r in rows}
    # Time-boxed: the site slowed 4× trains fewer steps per round than the fast one; fixed H trains the same.
    assert by[4.0, "timebox"]["slow_h"] < by[4.0, "timebox"]["fast_h"]
    assert by[4.0, "fixed"]["slow_h"] == by[4.0, "fixed"]["fast_h"] == 8
    # Fixed H with a slowed site does the same rounds as with even sites, only later — the same arithmetic
    # but for the step each round's merge comes at (the first step its exchange is back: timing decides,
    # `--overlap-steps`), so the same loss to within a few per cent, not to the bit.
    fixed_even, fixed_slowed = by[1.0, "fixed"]["final_eval_loss"], by[4.0, "fixed"]["final_eval_loss"]
    assert abs(fixed_slowed - fixed_even) < 0.03 * fixed_even, (fixed_even, fixed_slowed)
    assert "| 2 | 4 | timebox |" in (out / "uneven.md").read_text()
