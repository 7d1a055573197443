"""`dilocox bench speed`: the site (a `dilocox worker` against a `dilocox server`) against a plain torch loop of
the same model, batch, optimizer and data."""

from __future__ import annotations

import pytest

from dilocox.bench.site_speed import flops_per_token, peak_flops, speed_row
from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.build import build_model


def test_a_row_times_both_loops_on_the_same_steps_and_says_the_ratio():
    base = {"device": "cpu", "batch_size": 4, "block_size": 32, "steps": 2, "rounds": 3, "threads": 1, "data": None}
    row = speed_row("gpt", "byte", "fp32", "off", base)
    assert "error" not in row, row
    assert row["plain_tokens_per_s"] > 0 and row["site_tokens_per_s"] > 0
    assert row["site_over_plain"] == pytest.approx(row["site_tokens_per_s"] / row["plain_tokens_per_s"], rel=1e-2)
    assert row["inner_over_plain"] >= row["site_over_plain"] and 0 <= row["boundary_share"] < 1
    assert row["plain_peak_mb"] > 0 and row["site_peak_mb"] > 0 and row["memory"] == "RSS"
    assert row["plain_mfu"] == row["site_mfu"] == "—"  # no peak is named for a CPU
    assert row["device"].startswith("CPU")


def test_flops_per_token_counts_the_matrices_and_attention_as_torchtitan_does():
    config = ModelConfig(n_layer=2, n_embd=64, n_head=4, block_size=32)
    model = build_model(config, 256, 0)
    width, layers = 64, 2
    matrices = sum(p.numel() for p in model.parameters()) - (256 + 32) * width  # without the embedding tables
    assert flops_per_token(model, 32) == 6 * matrices + 12 * layers * width * 32


def test_the_peak_is_named_only_for_bf16_on_a_known_device():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "fp32") is None
    assert peak_flops("CPU (2 cores)", "bf16") is None
