"""`dilocox bench resume` (issue 44): a restart k versions behind pulls the rounds it missed, and its
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
    assert one["bytes_down"] < three["bytes_down"] < three["full_pull_bytes"] / 4  # each round compressed, not the model
    assert 4 * one["params"] < one["full_pull_bytes"] < 8.5 * one["params"]  # the weights and momentum (zstd-packed fp32)


def test_the_107b_projection_counts_every_sites_round_against_8_bytes_a_parameter():
    rows = projection(_args("--project-sites", "2,20"), [1, 2])
    by = {(r["sites"], r["behind"]): r for r in rows}
    assert by[20, 2]["delta_bytes"] == 10 * by[2, 2]["delta_bytes"] == 20 * by[2, 1]["delta_bytes"]
    assert by[2, 1]["full_bytes"] == 8 * 106_881_261_568  # the dense 107B model's weights and momentum in fp32
    assert by[2, 1]["full_s"] == by[20, 2]["full_s"] and by[2, 1]["delta_s"] < by[2, 1]["full_s"] / 100
