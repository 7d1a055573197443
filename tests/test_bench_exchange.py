"""`dilocox bench exchange` end to end on a small layer: every stage timed against its same-run reference,
for the thread counts asked for, and the training-beside-exchange figure with its floors."""

from __future__ import annotations

import json
import subprocess
import sys

from dilocox.bench.exchange import CLUSTER_STAGES, STAGES, layer_shapes


def test_layer_shapes_are_a_llama_layers_matrices():
    shapes = layer_shapes("llama-1b")
    assert shapes["layers.0.q_proj"] == (2048, 2048) and shapes["layers.0.k_proj"] == (256, 2048)
    assert shapes["layers.0.gate_proj"] == (5632, 2048) and shapes["layers.0.down_proj"] == (2048, 5632)
    assert len(layer_shapes("llama-tiny", layers=2)) == 14


def test_exchange_bench_writes_every_stage_with_its_reference(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "bench",
            "exchange",
            "--model",
            "llama-20m",
            "--threads",
            "1,2",
            "--repeats",
            "1",
            "--train-seconds",
            "1",
            "--pace-s",
            "0.2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "exchange.json").read_text())
    rows = report["rows"]
    for threads in (1, 2):
        mine = {r["stage"]: r for r in rows if r["threads"] == threads}
        assert set(STAGES) < set(mine)
        assert all(mine[s]["ns_per_param"] > 0 for s in STAGES)
        for stage in ("compress_ef", "decode", "replay", "replay_check", "shard_close"):
            assert mine[stage]["reference_ns"] > 0 and mine[stage]["x_reference"] > 0
        total = sum(mine[s]["ns_per_param"] for s in CLUSTER_STAGES)
        assert abs(mine["cluster exchange (sum)"]["ns_per_param"] - total) < 0.05
    training = report["meta"]["training"]
    assert set(training) == {"exchange", "paced", "idle", "cache", "stream"}
    assert training["exchange"]["exchange_rounds_meanwhile"] >= 1 and 0 < training["exchange"]["share_kept"] <= 1.5
    assert "kept" in (out / "exchange.md").read_text()
