"""`dilocox bench projection`: its byte count is the compressor's own, and its arithmetic is the one
the document states (AllReduce ratio, the H at which communication hides)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from dilocox.bench.projection import MODELS, compressed_bytes, exchange_costs, measured_costs, project
from dilocox.common.wire.assignment import assign_slices
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor

SPECS = [("emb", (300, 64)), ("w", (64, 256)), ("norm", (64,)), ("small", (8, 8))]


def test_compressed_bytes_are_what_the_compressor_sends_at_its_highest_rank():
    config = CompressionConfig(adaptive_rank=False)  # always rank_max, where error feedback keeps it
    compressor = TensorCompressor(config, seed=1)
    sent = 0
    for s in assign_slices(SPECS, 2):
        sent += len(bytes(compressor.compress(s.key, torch.randn(s.slice_shape)).payload))
    assert compressed_bytes(SPECS, 2, config) == sent


def test_paper_models_have_their_sizes():
    sizes = {name: sum(math.prod(s) for _, s in build()) for name, build in MODELS.items()}
    assert 1.30e9 < sizes["opt-1.3b"] < 1.33e9 and 106e9 < sizes["dense-107b"] < 108e9


def test_projection_arithmetic(tmp_path):
    report = tmp_path / "scale.json"
    row = {
        "model": "m",
        "params_M": 100.0,
        "M": 2,
        "full_M": 2,
        "N": 2,
        "codec": "default",
        "compress_s": 1.0,
        "pull_replay_s": 2.0,
        "decode_apply_MB_s": 1000.0,
        "shard_rss_vs_owned": 3.0,
        "checkpoint_MB": 800.0,
        "checkpoint_write_s": 2.0,
    }
    others = [
        {**row, "params_M": 10.0},
        {**row, "codec": "fp32", "params_M": 500.0},
        {**row, "error_feedback": False, "params_M": 900.0},
    ]
    report.write_text(json.dumps({"rows": [row, *others]}))
    costs = measured_costs(report)
    assert costs["compress_s_per_param"] == 1.0 / 100e6 and costs["shard_dense_bytes_per_s"] == 1e9
    args = argparse.Namespace(sites=2, link_gbit=1.0, shards=2, cluster_cores=1, shard_cores=1, shard_ram_gb=1000.0)
    out = project("tiny", SPECS, 2.0, costs, args)
    params = sum(math.prod(s) for _, s in SPECS)
    allreduce_s = 4 * params / 125e6  # 2 sites: a ring moves the whole fp32 model through each link per step
    assert math.isclose(out["ratio_vs_allreduce"], round((2.0 + allreduce_s) / 2.0, 1))
    assert out["H_hides"] == 1 and out["up_MB"] == out["down_MB"]  # tiny: one step covers it; 2 sites forward one push


def test_projection_from_an_exchange_report_takes_its_one_thread_stage_costs(tmp_path):
    stages = {
        "pseudo_gradient": 0.5,
        "compress_ef": 2.5,
        "frame_zstd": 0.0,
        "vet": 0.1,
        "decode": 0.7,
        "replay": 1.5,
        "replay_check": 0.3,
        "shard_close": 0.8,
    }
    rows = [
        {"threads": t, "stage": s, "ns_per_param": ns * (1 if t == 1 else 9)}
        for t in (1, 2)
        for s, ns in stages.items()
    ]
    report = tmp_path / "exchange.json"
    report.write_text(json.dumps({"rows": rows, "meta": {"clusters": 2}}))
    costs = exchange_costs(report, rss_vs_owned=3.5)
    assert math.isclose(costs["compress_s_per_param"], 3.0e-9) and math.isclose(costs["replay_s_per_param"], 1.9e-9)
    assert math.isclose(costs["shard_dense_bytes_per_s"], 8 / 0.8e-9) and costs["shard_rss_vs_owned"] == 3.5
    report.write_text(json.dumps({"rows": [r for r in rows if r["stage"] != "replay_check" or r["threads"] != 1]}))
    with pytest.raises(SystemExit, match="replay_check"):
        exchange_costs(report, 3.5)
