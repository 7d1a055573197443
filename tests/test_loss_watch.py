"""The site's loss watch (worker/exchange/loss_watch.py): a spike, a rise that no single round shows, a
non-finite loss — and the best it keeps."""

from __future__ import annotations

import math

from dilocox.worker.exchange.loss_watch import RISE_RATIO, RISE_ROUNDS, LossWatch


def test_a_spike_a_sustained_rise_and_a_non_finite_loss_are_each_named():
    watch = LossWatch()
    assert [watch.observe(r, loss) for r, loss in enumerate((3.0, 2.6, 2.52), 1)] == [None, None, None]
    assert watch.observe(4, 4.0) is not None and watch.kind == "spike"
    watch = LossWatch()
    assert [watch.observe(r, loss) for r, loss in enumerate((3.0, 2.6, 2.52), 1)] == [None, None, None]
    # Issue 62's honest site: 2.52 → 2.99 over rounds, never 1.5× in one. A rise is called on the third
    # round in a row above 1.1× the best, and not before.
    kinds = []
    for r, loss in enumerate((2.8, 2.9, 2.99, 2.95), 5):
        verdict = watch.observe(r, loss)
        kinds.append(watch.kind if verdict else None)
    assert 2.8 > RISE_RATIO * 2.52 and kinds[:2] == [None, None] and kinds[2:] == ["rising", "rising"] and RISE_ROUNDS == 3
    assert watch.rising == 4 and "5 rounds in a row" in watch.observe(9, 2.9)
    assert watch.observe(10, 2.5) is None and watch.rising == 0 and watch.best == 2.5  # back under: the count ends


def test_a_bump_that_comes_back_is_not_a_rise_and_nan_is_non_finite():
    watch = LossWatch()
    for r, loss in enumerate((3.0, 2.5, 2.8, 2.8, 2.5, 2.8, 2.8, 2.4), 1):  # two rounds up, then back: DiLoCo's swing
        assert watch.observe(r, loss) is None, (r, loss)
    assert watch.observe(9, math.nan) is not None and watch.kind == "nonfinite" and watch.last_ratio == math.inf


def test_a_restarted_site_judges_against_the_best_before_its_restart():
    """The cluster seeds the watch from the trainer's `eval_best`, which the site's checkpoint restores: a
    faulty restart whose eval goes 4.8 → 16.4 is a spike against the 2.5 it had, not a fresh start."""
    watch = LossWatch()
    watch.best = min(watch.best, 2.5)  # as DilocoCluster._watch_losses does from trainer.eval_best
    assert watch.observe(30, 4.8) is not None and watch.kind == "spike"
