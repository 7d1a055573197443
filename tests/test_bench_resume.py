"""`dilocox bench resume`: a restart k versions behind pulls the rounds it missed, and its
replica equals a full pull's; a replica older than the shards keep is pulled in full."""

from __future__ import annotations

import argparse

from dilocox.bench.resume import add_arguments, measure, projection


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--rounds", "4", "--inner-steps", "1", *argv])


def test_a_restart_pulls_the_rounds_it_missed_and_ends_on_the_same_replica():
    rows = measure("gpt", _args(), [1, 3])
    assert [(r["behind"], r["how"], r["replica_equal"]) for r in rows] == [(1, "delta", True), (3, "delta", True)]
    one, three = rows
    assert (
        one["bytes_down"] < three["bytes_down"] < three["full_pull_bytes"] / 4
    )  # each round compressed, not the model
    assert (
        4 * one["params"] < one["full_pull_bytes"] < 8.5 * one["params"]
    )  # the weights and momentum (zstd-packed fp32)


def test_the_107b_projection_counts_every_sites_round_against_8_bytes_a_parameter():
    rows = projection(_args("--project-sites", "2,20"), [1, 2])
    by = {(r["sites"], r["behind"]): r for r in rows}
    assert by[20, 2]["delta_bytes"] == 10 * by[2, 2]["delta_bytes"] == 20 * by[2, 1]["delta_bytes"]
    assert by[2, 1]["full_bytes"] == 8 * 106_881_261_568  # the dense 107B model's weights and momentum in fp32
    assert by[2, 1]["full_s"] == by[20, 2]["full_s"] and by[2, 1]["delta_s"] < by[2, 1]["full_s"] / 100


def test_a_day_away_replays_every_sites_rounds_of_the_day_which_the_shards_keep_on_disk():
    from dilocox.bench.resume import away_projection

    rows = away_projection(_args("--project-sites", "2,8", "--away-s", "86400", "--round-s", "1000"))
    by = {(r["model"], r["sites"]): r for r in rows}
    assert {r["rounds_missed"] for r in rows} == {87}  # ⌈86,400 / 1,000⌉
    assert by["llama-3-70b", 8]["delta_bytes"] == 4 * by["llama-3-70b", 2]["delta_bytes"]
    assert by["llama-3-70b", 2]["full_bytes"] == 8 * 70_553_706_496  # Llama-3-70B's weights and momentum in fp32
    for row in rows:  # a day of rounds is still a small share of the model, and it is what the shards keep
        assert row["delta_bytes"] < row["full_bytes"] / 5 and row["kept_on_disk_gb"] == row["delta_gb"]
