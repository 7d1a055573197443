"""`dilocox bench train --layouts … --layout-variants …` (bench/site_layouts.py): a row from a site's log
lines, and the variants' flags. The runs themselves are real torchrun sites (minutes each): their figures
are in docs/performance.md; here, what the report makes of the lines a worker logs."""

from __future__ import annotations

import argparse

import pytest

from dilocox.bench.site_layouts import VARIANTS, LayoutRun, layout_flags, summarize


def _events() -> list[dict]:
    events = [{"event": "rank_share", "rank": r, "params_held": 25_000_000} for r in (0, 1)]
    for round_ in (1, 2, 3):
        for rank, rss in ((0, 1000 + 100 * round_), (1, 900 + 10 * round_)):
            events.append(
                {
                    "event": "boundary_done",
                    "rank": rank,
                    "round": round_,
                    "rss_before_mb": rss,
                    "read_s": 0.1,
                    "write_s": 0.2,
                }
            )
        events.append(
            {"event": "round_done", "rank": 0, "round": round_, "seconds": 2.0, "compute_s": 1.5, "tokens": 300}
        )
    for rank in (0, 1):
        events.append(
            {
                "event": "exchange_memory",
                "rank": rank,
                "params_owned": 1_000_000,
                "total_bytes": 12_500_000,
                "own_push_bytes": 500_000,
                "bytes_per_held_param": 0.5,
                "spilled_bytes": 4_000_000,
            }
        )
    return events


def test_a_row_reports_the_steady_resident_set_and_the_bytes_per_owned_parameter():
    run = LayoutRun(
        1, 2, extra=VARIANTS["lean"], variant="lean", events=_events(), peak_rss_kb={0: 2048 * 1024, 1: 1024 * 1024}
    )
    row = summarize(run)
    assert row["layout"] == "pp1×dp2 lean"
    assert row["steady_rss_mb_per_rank"] == [1300, 930]  # the most of rounds 2-3, as each round's training ended
    assert row["exchange_bytes_per_owned_param"] == [12.0, 12.0]  # less the last push's payloads
    assert row["peak_rss_mb_per_rank"] == [2048, 1024] and row["tokens_per_s"] == 200
    assert "rss_before_mb" not in row["boundary_phases_s"]


def test_a_variants_folders_are_its_own_and_an_unknown_variant_is_refused_by_name():
    flags = layout_flags(LayoutRun(2, 2, extra=VARIANTS["lean"], variant="lean"))
    assert flags[-6:] == [
        "--checkpoint-dir",
        "{work}/checkpoints",
        "--checkpoint-staging",
        "sync",
        "--spill-dir",
        "{work}/spill",
    ]
    from dilocox.bench.train import _layout_rows

    args = argparse.Namespace(layouts="1x2", layout_variants="memory,fast", layout_model="--n-layer 1")
    with pytest.raises(SystemExit, match="--layout-variants fast: not one of memory, checkpointed, lean"):
        _layout_rows(args)
