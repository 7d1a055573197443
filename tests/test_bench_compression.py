"""`dilocox bench compression` end to end on a tiny run: real shards on localhost gRPC, two clusters."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest


def test_compression_bench_writes_a_table_with_every_setting(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "bench",
            "compression",
            "--rounds",
            "2",
            "--inner-steps",
            "3",
            "--settings",
            "r6-sync,default-sync",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((out / "compression.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["fp32-sync", "r6-sync", "default-sync"]  # the reference runs first
    assert "| fp32-sync |" in (out / "compression.md").read_text()
    for row in rows:
        assert math.isfinite(row["final_eval_loss"]), row
    reference, strong, default = rows  # strong: the lean (rank ≤ 6) preset
    assert reference["withheld_signal"] == 0.0 and reference["loss_vs_reference"] == "+0.0%"
    assert 0 < strong["withheld_signal"] < 1 and 0 < default["withheld_signal"] < 1
    assert strong["up_vs_dense_fp32"] >= default["up_vs_dense_fp32"] > 10 * reference["up_vs_dense_fp32"]
    # the end-of-run flush of the residuals: a one-off reported apart, none for dense fp32
    assert reference["flush_bytes_up"] == 0 and default["flush_bytes_up"] > 0 and default["flush_in_rounds"] > 0
    # ‖ΣΔ − Σ decoded‖ after each quarter of the rounds: zero for dense fp32, positive when compressed
    assert reference["withheld_norm_by_quarter"] == " → ".join(["0.000"] * 4)
    assert all(float(v) > 0 for v in strong["withheld_norm_by_quarter"].split(" → ")[1:])


def test_unknown_setting_is_a_clear_error():
    from dilocox.bench.compression import chosen_settings

    with pytest.raises(SystemExit, match="unknown setting"):
        chosen_settings("default,nope")
