"""`dilocox bench scale` at a tiny size: real shard processes, the project's clients; the row it reports
holds what the benchmark promises (bytes both ways, times, memory, checkpoints, a joiner's full pull)."""

from __future__ import annotations

from dilocox.bench.scale import run_setting

SPECS = [("emb", (256, 64)), ("w", (64, 128)), ("b", (128,))]
REFERENCE = {"torch_copy": 10_000.0, "torch_add": 20_000.0}


def test_bench_scale_one_setting_reports_every_figure():
    row = run_setting("tiny", SPECS, clusters=2, shards=2, codec="default", rounds=1, reference=REFERENCE)
    assert row["params_M"] == round((256 * 64 + 64 * 128 + 128) / 1e6, 1) and (row["M"], row["full_M"], row["N"]) == (
        2,
        2,
        2,
    )
    assert 0 < row["up_MB"] and 0 < row["down_MB"]
    assert row["push_s"] > 0 and row["pull_replay_s"] > 0 and row["joiner_full_pull_s"] > 0
    assert row["shard_rss_MB"] > 0 and row["clients_rss_MB"] > 0
    assert row["decode_apply_MB_s"] is None or row["decode_apply_MB_s"] > 0
    # Every round was checkpointed, and shard 0 came back from its checkpoint.
    assert (
        row["checkpoint_MB"] > 0 and row["checkpoint_write_s"] is not None and row["checkpoint_restore_s"] is not None
    )


def test_bench_scale_with_push_only_clusters():
    """One full cluster replays, two push only (no replica, no error feedback): the shards still close
    every round with three contributions, and the full cluster's downlink carries the two others."""
    row = run_setting("tiny", SPECS, clusters=3, shards=1, codec="default", rounds=1, reference=REFERENCE, full=1)
    assert (row["M"], row["full_M"]) == (3, 1)
    assert row["close_s"] is not None and row["pull_replay_s"] > 0 and row["down_MB"] > row["up_MB"]


def test_scale_plots_are_drawn_from_report_rows(tmp_path):
    from dilocox.bench.scale_plots import write_scale_plots

    base = {
        "codec": "default",
        "push_s": 1.0,
        "close_s": 0.5,
        "pull_replay_s": 2.0,
        "shard_rss_vs_owned": 3.0,
        "clients_rss_per_param_B": 20.0,
    }
    rows = [
        {**base, "params_M": p, "M": m, "N": n, "push_s": p * m / n}
        for p in (10.0, 100.0)
        for m in (2, 4)
        for n in (1, 2, 4)
    ]
    names = write_scale_plots(tmp_path, rows)
    assert set(names) == {"time_vs_params.png", "memory_vs_params.png", "time_vs_clusters.png", "time_vs_shards.png"}
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)
