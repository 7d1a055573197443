"""The step-driven half of a cluster's round loop: a user's loop (or `run`) reports inner steps, and a
round closes when its H is trained or its time box says so (the API's step() calls, or the time box's clock).

Mixed into `DilocoCluster` (worker/exchange/cluster.py), whose state and boundary (`close_round`,
`finish`, `communicator`, `checkpoint`, …) it uses; kept apart so that each half stays readable.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc
import structlog
import torch

from dilocox.worker.exchange.aggregator_client import AggregatorError
from dilocox.worker.exchange.communicator import Communicator
from dilocox.worker.exchange.round_report import RoundReport
from dilocox.worker.exchange.stop import STOP_GRACE_S, StopDuringExchange, StopSignal

if TYPE_CHECKING:
    from dilocox.worker.exchange.adaptive_steps import RoundTimeBox
    from dilocox.worker.exchange.communicator import RoundExchange

log = structlog.get_logger()
# A stoppable run trains a fixed-H round in about this many pieces, agreeing after each whether to stop.
STOP_CHECKS_PER_ROUND = 8


class StepDriven:
    """Mixed into `DilocoCluster`: `begin`, `after_steps`, `run`, `close` and the round's step count."""

    time_box: RoundTimeBox | None

    @property
    def steps_to_sync(self) -> int:
        """Inner steps to train before the round may close (0 once the run is done): the rest of its H, or
        with a time box the steps to its next check of the clock (the round closes there if time is up)."""
        if self.done:
            return 0
        left = (
            self.time_box.steps_to_check(self._steps) if self.time_box is not None else self.inner_steps - self._steps
        )
        if self._merge_pending():  # from τ steps in, every step asks whether the exchange is back
            left = min(left, max(1, self.overlap_steps - self._steps))
        return left

    def _merge_pending(self) -> bool:
        """Whether the previous round's exchange may still be merged inside this round (`overlap_steps`):
        from τ steps in, at the first step it is back; what is not back by the round's end the boundary
        waits for and takes in, as the plain one-step delay does."""
        return 0 < self.overlap_steps < self.inner_steps and self.communicator.in_flight is not None

    def _merge_now(self) -> bool:
        """τ or more steps in and the exchange back on every rank of the site (`merge_wait`: waited for at τ)."""
        if not self._merge_pending() or self._steps < self.overlap_steps:
            return False
        if self.merge_wait:
            return self._steps == self.overlap_steps
        return not self.access.agree_any(not self.communicator.ready)

    @property
    def steps_in_round(self) -> int:
        """Inner steps trained so far in the round being trained."""
        return self._steps

    def begin(self) -> None:
        """Join and adopt the global model; the first round to train is `self.round`."""
        self.round = self.start()
        self._reset_round()
        if self.round > self.rounds:  # resumed after the last round: only the end is left
            self._complete()

    def _reset_round(self) -> None:
        self._steps, self._tokens, self._loss_sum, self._loss_steps = 0, 0, 0.0, 0
        self._compute_s: float | None = None  # summed over the calls that said it
        self._round_began = time.perf_counter()
        if self.time_box is not None:
            self.time_box.begin_round(self.round, time.monotonic())

    def after_steps(
        self, steps: int, tokens: int, loss: float | torch.Tensor | None = None, compute_s: float | None = None
    ) -> RoundReport | None:
        """`steps` inner steps were taken (of `steps_to_sync` left), training `tokens` tokens with mean loss
        `loss`; at the round's last step the round closes. Returns its report then, else None (also when
        the site had to rejoin: the shards went on without it, and the model now holds their weights).
        `compute_s`: these steps' compute time (default: the round's is the wall time since it began)."""
        if self.done:
            raise RuntimeError("the run is over: no more inner steps to take")
        if not 0 < steps <= self.steps_to_sync:
            raise ValueError(f"{steps} steps given, but {self.steps_to_sync} are left before the next sync")
        self._steps += steps
        self._tokens += int(tokens)
        if loss is not None:  # a device tensor stays one until the round closes: no sync per step
            self._loss_sum = self._loss_sum + (loss.detach() if isinstance(loss, torch.Tensor) else float(loss)) * steps
            self._loss_steps += steps
        if compute_s is not None:
            self._compute_s = (self._compute_s or 0.0) + compute_s
        complete = self._round_complete()
        merge = not complete and self._merge_now()
        if not (complete or merge):
            return None
        try:
            if merge:  # τ steps in: the previous round's merged model is taken in now (`overlap_steps`)
                self.merge_in_flight(self.round, self._tokens)
                return None
            compute_s = time.perf_counter() - self._round_began if self._compute_s is None else self._compute_s
            # nan: no loss given
            train_loss = float(self._loss_sum) / self._loss_steps if self._loss_steps else float("nan")
            report = self.close_round(self.round, train_loss, self._tokens, compute_s)
        except AggregatorError as error:
            if error.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # The shards went on without us (a missed deadline made us inactive, or our round closed):
            # rejoin, adopt the current global weights and carry on from there.
            log.warning("cluster_rejoining", cluster=self.client.cluster, round=self.round, reason=error.details)
            self.communicator.close(timeout=0)
            self.communicator = Communicator(
                self.client, pull_names=tuple(self.names), pull_wait_s=self.client.pull_wait_s
            )
            self.begin()
            return None
        self.reports.append(report)
        self.round = report.round + 1
        self._reset_round()
        if self.round > self.rounds:
            self._complete()
        return report

    def _round_complete(self) -> bool:
        """Whether the round being trained ends after the steps taken so far (a time box asks the clock,
        agreed over the site's ranks; then the round's H is what it trained)."""
        if self.time_box is None:
            return self._steps >= self.inner_steps
        if not self.time_box.ends_after(self._steps, self.access.agree_min):
            return False
        self.inner_steps = self._steps  # what this round trained: its report, its push's facts
        return True

    def _complete(self) -> None:
        """The last round is in: end on the global model (`finish`), evaluate it, log the run's totals."""
        self.finish()
        self.done = True
        self.final_eval_loss = self.trainer.evaluate() if self.reports else self.initial_eval_loss
        self._log_memory()
        log.info(
            "cluster_done",
            cluster=self.client.cluster,
            delay=self.delay,
            rounds=len(self.reports),
            version=self.version,
            initial_eval_loss=round(self.initial_eval_loss or float("nan"), 4),
            final_eval_loss=round(self.final_eval_loss, 4) if self.final_eval_loss is not None else None,
            idle_s=round(sum(r.idle_s for r in self.reports), 3),
            compute_s=round(sum(r.compute_s for r in self.reports), 3),
            bytes_up=self.client.traffic.bytes_up,
            bytes_down=self.client.traffic.bytes_down,
        )

    def close(self) -> None:
        """Finish or abandon the exchange in flight and the checkpoint writes (idempotent). A round whose
        exchange completes here is on the shards: its checkpoint is committed."""
        if self._closed:
            return
        self._closed = True
        pending = self.communicator.in_flight
        outcome = self.communicator.close(timeout=self._stop.grace_s if self._stop is not None else STOP_GRACE_S)
        log.info("communicator_closed", cluster=self.client.cluster, outcome=outcome, round=pending)
        if outcome in ("completed", "pushed") and pending is not None:
            self._commit(pending)  # its part is on the shards: that round is durable now
        if self.checkpoint is not None:
            self.checkpoint.close()

    def run(self, stop: StopSignal | None = None) -> list[RoundReport]:
        """Drive a `LocalTrainer` through the whole run: the same steps as a user's loop over `dilocox.DiLoCoX`.
        With `stop` (worker/exchange/stop.py) it trains a round in a few pieces and, after each, the ranks
        agree whether a stop was asked for; then it leaves the loop (the round being trained is not pushed)
        and `close` commits what the shards have."""
        self._stop = stop
        try:
            self.begin()
            while not self.done:
                steps = self.steps_to_sync
                if stop is not None:
                    steps = min(steps, max(1, -(-self.inner_steps // STOP_CHECKS_PER_ROUND)))
                train_loss, tokens, compute_s = self.trainer.train_steps(steps)
                try:
                    self.after_steps(steps, tokens, train_loss, compute_s)
                except StopDuringExchange:  # the boundary's wait gave up for the stop (worker/exchange/stop.py)
                    self._stopping(stop, "the round just trained is not pushed; the exchange in flight had its grace")
                    self._commit_after_stop()
                    break
                if stop is not None and not self.done and self.access.agree_any(stop.requested):
                    self._stopping(
                        stop,
                        "the round being trained is not pushed; the exchange in flight may finish and "
                        "commit its checkpoint",
                    )
                    break
        finally:
            self.close()
        return self.reports

    def _check_stop(self, exchange: RoundExchange | None) -> None:
        """Under `run(stop)`: leave the boundary on every rank if any rank gave up waiting for a stop. A rank
        whose exchange did come back keeps its round for the agreed commit (`_commit_after_stop`)."""
        if self._stop is not None and self.access.agree_any(self._stop_waited):
            self._stop_waited = True
            self._collected_before_stop = exchange.round if exchange is not None else None
            raise StopDuringExchange()

    def _commit_after_stop(self) -> None:
        """After `StopDuringExchange`, on every rank: the round whose part every rank has on the shards (its
        exchange came back, or at least its push got through) is committed — agreed, as the commit is
        collective; a round any rank could not push stays uncommitted (a resume trains it again)."""
        pending = self.communicator.in_flight
        outcome = self.communicator.close(timeout=0.0)
        mine = pending if pending is not None and outcome in ("completed", "pushed") else self._collected_before_stop
        agreed = self.access.agree_min(mine if mine is not None else -1)
        if agreed >= 0 and self.access.agree_max(mine if mine is not None else -1) == agreed:
            self._commit(agreed)
        log.info(
            "communicator_closed", cluster=self.client.cluster, outcome=outcome, round=pending, committed=agreed >= 0
        )

    def _stopping(self, stop: StopSignal, reason: str) -> None:
        self.stopped_by = stop.name or "another rank's signal"
        log.warning(
            "worker_stopping",
            cluster=self.client.cluster,
            signal=self.stopped_by,
            round=self.round,
            steps_in_round=self._steps,
            in_flight=self.communicator.in_flight,
            reason=reason,
        )
