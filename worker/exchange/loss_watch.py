"""What blows a model up, seen in its loss curve: a non-finite value, or a jump past a bound.

A late site's stale work merged at 95 % weight once took both sites' eval loss from 6.8 to 29 with no
alert and two warnings that did not say so. Each site watches the eval of the model it starts every round
from (the global weights less its own residual and round in flight: where the global model goes, it
goes), logs `loss_spike` / `loss_nonfinite` and exports the ratio to its best eval so far, which the
shipped alert rules read per site and over all sites (every site spiking at once is the global model);
the sim watches the global model itself (sim/global_eval.py).

A spike is not the only harm: a faulty partner merged at full weight once took an honest site's
eval from 2.52 to 2.99 (+19 %), round by round, never 1.5× in one. So the watch also calls a **rise**: the
eval above `RISE_RATIO` × the best for `RISE_ROUNDS` rounds in a row (`loss_rising`). And it keeps its best
across a site's restarts (the site's checkpoint carries it, `eval_best`): a restarted faulty site whose eval
went 4.8 → 16.4 raised nothing, its best forgotten.
"""

from __future__ import annotations

import contextlib
import math

import structlog

log = structlog.get_logger()

# A round's eval more than this many times the best so far is a spike. Ordinary training noise between
# rounds is a few percent; a merged update that blows a model up multiplies the loss.
SPIKE_RATIO = 1.5
# Above the best by more than this, this many rounds in a row, is a rise: DiLoCo's eval moves a few percent
# between rounds as the outer momentum swings, and comes back within a round or two.
RISE_RATIO = 1.1
RISE_ROUNDS = 3


class LossWatch:
    def __init__(self, ratio: float = SPIKE_RATIO) -> None:
        if not ratio > 1:
            raise ValueError(f"a spike ratio must be > 1, got {ratio}")
        self.ratio = ratio
        self.best = math.inf
        self.last_ratio = math.nan  # the last observed loss over the best before it (nan: nothing to compare)
        self.nonfinite = 0  # non-finite losses seen
        self.rising = 0  # rounds in a row above RISE_RATIO × the best
        self.kind: str | None = None  # what the last alarming observation was: spike, rising, nonfinite

    def observe(self, round_: int, loss: float) -> str | None:
        """Take round `round_`'s loss; returns why it is alarming, or None."""
        self.kind = None
        if not math.isfinite(loss):
            self.nonfinite += 1
            self.last_ratio = math.inf
            self.kind = "nonfinite"
            return f"round {round_}'s loss is {loss}"
        verdict = None
        if math.isfinite(self.best):
            self.last_ratio = loss / self.best if self.best > 0 else math.nan
            self.rising = self.rising + 1 if loss > RISE_RATIO * self.best else 0
            if loss > self.ratio * self.best:
                verdict, self.kind = (
                    f"round {round_}'s loss {loss:.4f} is over {self.ratio:g}× the best so far ({self.best:.4f})",
                    "spike",
                )
            elif self.rising >= RISE_ROUNDS:
                verdict, self.kind = (
                    (
                        f"round {round_}'s loss {loss:.4f} has been over {RISE_RATIO:g}× the best so far "
                        f"({self.best:.4f}) "
                        f"for {self.rising} rounds in a row"
                    ),
                    "rising",
                )
        self.best = min(self.best, loss)
        return verdict


def watch_round(
    watch: LossWatch,
    report,
    cluster: str,
    trainer: object,
    evaluated: bool,
    caught_up: bool,  # noqa: ANN001
    train_loss_given: bool = True,
) -> None:
    """Say it when the model a site starts from blows up; the verdict goes into `report` (a RoundReport:
    metrics and alerts read it). The best eval survives a restart: the site's checkpoint carries it on the
    trainer (`eval_best`). A spike at a boundary that `caught_up` (the site started from global weights
    rounds newer than those it trained on) is a warning, `loss_after_catch_up`, not an alarm: an honest slow
    site went 3.78 → 8.31 for one round and back, paging an operator with nothing to do; if it stays up,
    `loss_rising` fires as it would."""
    if not math.isfinite(report.train_loss) and train_loss_given:  # nan without a loss: none was given
        report.loss_alarm = "nonfinite"
        log.error(
            "loss_nonfinite",
            cluster=cluster,
            round=report.round,
            train_loss=report.train_loss,
            reason="the inner steps' loss is not finite",
        )
    if not evaluated:
        return
    watch.best = min(watch.best, getattr(trainer, "eval_best", math.inf))
    verdict = watch.observe(report.round, report.eval_loss)
    report.eval_to_best, report.loss_rising_rounds = watch.last_ratio, watch.rising
    with contextlib.suppress(AttributeError):  # a user's trainer that takes no attributes: not kept
        trainer.eval_best = watch.best
    if verdict is None:
        return
    if caught_up and watch.kind == "spike":
        log.warning(
            "loss_after_catch_up",
            cluster=cluster,
            round=report.round,
            eval_loss=report.eval_loss,
            best=watch.best,
            reason=verdict + "; right after a catch-up: not an alarm unless it stays up",
        )
        return
    report.loss_alarm = report.loss_alarm or watch.kind
    log.error(
        f"loss_{watch.kind}",
        cluster=cluster,
        round=report.round,
        eval_loss=report.eval_loss,
        best=watch.best,
        reason=verdict,
    )
