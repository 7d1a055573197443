"""`dilocox bench scale` at a tiny size: real shard processes, the project's clients; the row it reports
holds what the benchmark promises (bytes both ways, times, memory, checkpoints, a joiner's full pull)."""

from __future__ import annotations

from dilocox.bench.scale import run_setting

SPECS = [("emb", (256, 64)), ("w", (64, 128)), ("b", (128,))]
REFERENCE = {"torch_copy": 10_000.0, "torch_add": 20_000.0}


def test_bench_scale_one_setting_reports_every_figure():
    row = run_setting("tiny", SPECS, clusters=2, shards=2, codec="default", rounds=1, reference=REFERENCE)
    assert row["params_M"] == round((256 * 64 + 64 * 128 + 128) / 1e6, 1) and (row["M"], row["full_M"], row["N"]) == (2, 2, 2)
    assert 0 < row["up_MB"] and 0 < row["down_MB"]
    assert row["push_s"] > 0 and row["pull_replay_s"] > 0 and row["joiner_full_pull_s"] > 0
    assert row["shard_rss_MB"] > 0 and row["clients_rss_MB"] > 0
    assert row["decode_apply_MB_s"] is None or row["decode_apply_MB_s"] > 0
    # Every round was checkpointed, and shard 0 came back from its checkpoint.
    assert row["checkpoint_MB"] > 0 and row["checkpoint_write_s"] is not None and row["checkpoint_restore_s"] is not None


def test_bench_scale_with_push_only_clusters():
    """One full cluster replays, two push only (no replica, no error feedback): the shards still close
    every round with three contributions, and the full cluster's downlink carries the two others."""
    row = run_setting("tiny", SPECS, clusters=3, shards=1, codec="default", rounds=1, reference=REFERENCE, full=1)
    assert (row["M"], row["full_M"]) == (3, 1)
    assert row["close_s"] is not None and row["pull_replay_s"] > 0 and row["down_MB"] > row["up_MB"]
