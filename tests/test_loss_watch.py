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
    # An honest site next to a faulty partner: 2.52 → 2.99 over rounds, never 1.5× in one. A rise is called on the third
    # round in a row above 1.1× the best, and not before.
    kinds = []
    for r, loss in enumerate((2.8, 2.9, 2.99, 2.95), 5):
        verdict = watch.observe(r, loss)
        kinds.append(watch.kind if verdict else None)
    assert (
        2.8 > RISE_RATIO * 2.52 and kinds[:2] == [None, None] and kinds[2:] == ["rising", "rising"] and RISE_ROUNDS == 3
    )
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


def test_a_spike_right_after_a_catch_up_is_a_warning_and_one_that_stays_is_a_rise():
    """A slow site that caught up on rounds closed without it starts from much newer global weights: its own
    eval jumped 3.78 → 8.31 for one round (nothing for an operator to do). Not paged; if it stays, it is."""
    import structlog

    from dilocox.worker.exchange.loss_watch import watch_round
    from dilocox.worker.exchange.round_report import RoundReport

    def report(round_: int, eval_loss: float) -> RoundReport:
        return RoundReport(round_, 3.0, eval_loss, 100, 0, 0, 1.0, 0.0, 0.0, 1.0, 1.0)

    watch, trainer = LossWatch(), type("Trainer", (), {})()
    with structlog.testing.capture_logs() as logs:
        for r, loss, caught_up in [(1, 3.9, False), (2, 3.78, False), (3, 8.31, True), (4, 3.8, False)]:
            rep = report(r, loss)
            watch_round(watch, rep, "slow", trainer, evaluated=True, caught_up=caught_up)
            assert rep.loss_alarm == "", (r, rep)
    assert [e["event"] for e in logs] == ["loss_after_catch_up"] and logs[0]["round"] == 3
    assert trainer.eval_best == 3.78 and math.isclose(watch.last_ratio, 3.8 / 3.78)
    # The same jump without a catch-up pages; a catch-up whose loss stays up is a rise three rounds on.
    rep = report(5, 8.0)
    watch_round(watch, rep, "slow", trainer, evaluated=True, caught_up=False)
    assert rep.loss_alarm == "spike"
    alarms = []
    for r in (6, 7, 8):
        rep = report(r, 4.5)
        watch_round(watch, rep, "slow", trainer, evaluated=True, caught_up=True)
        alarms.append(rep.loss_alarm)
    assert alarms == ["", "rising", "rising"]  # over 1.1× the best for 3 rounds in a row (5, 6, 7)
