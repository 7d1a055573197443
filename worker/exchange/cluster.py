"""The outer loop of one cluster: DiLoCo rounds against the sharded aggregation service.

Both forms of DESIGN.md §3, one loop:

* ``delay=0`` (synchronous DiLoCo, the reference): train H steps from s_t = θ_{t-1}; send
  Δ_t = s_t − θ_local; wait for θ_t; adopt it; s_{t+1} = θ_t.
* ``delay=1`` (DiLoCoX one-step delay): train H steps from s_t; collect θ_{t-1} (it travelled while
  round t computed); Δ_t = s_t − θ_local; θ_local ← θ_{t-1} − Δ_t (the merged model with this round's
  own progress on top); s_{t+1} = θ_local; hand Δ_t to the background communicator. For the first round
  nothing is in flight and θ_{t-1} is s_t itself, so the same rule holds. After the last round the
  cluster collects θ_T. With `overlap_steps` τ (runs default to 1) θ_{t-1} is taken in earlier: from τ
  steps into round t on, at the first step it is back (`merge_in_flight`), with the same rule applied
  there; the boundary then finds nothing in flight.

Both forms then end alike. With error feedback the compressed rounds leave each cluster a residual the
shards never received; a flush round (`rounds + 1`, no inner steps) sends it once with a dense
quantiser, and the cluster adopts the resulting global model, so a run ends on the shards' model with
every cluster's progress in it (docs/decisions.md, "End-of-run flush").

With error feedback kept locally (`CompressionConfig.local_residual`, the default with error feedback)
θ_t in both rules is the global model minus the cluster's undelivered residual e (Σ Δ − Σ D(C(·)) of
its own messages): what it trains on holds all of its own progress, delivered or not, so it neither
re-learns the dropped part in the next round nor counts it twice when error feedback sends it later.

The first cluster to reach an uninitialised shard seeds it with its initial weights (round 0), so every
cluster starts from the same θ_0.

The loop works on the parameters this rank exchanges (`access.names`: all in one process, the rank's
share of its stage in a site) in two host buffers (`host_buffers`): s_t, and θ turned into Δ. A site's
ranks run it in step: the same rounds and collectives, and what could differ per rank (the round to
train, a rejoin) agreed over the site first (`access.agree_*`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

import structlog
import torch

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.staleness import stale_discount
from dilocox.worker.exchange.access import LocalAccess, ParameterAccess
from dilocox.worker.exchange.adaptive_steps import RoundTimeBox, StepsController
from dilocox.worker.exchange.admission import admission_checks
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError
from dilocox.worker.exchange.boundary import BoundaryTimer, log_exchange_memory
from dilocox.worker.exchange.communicator import Communicator, RoundExchange
from dilocox.worker.exchange.delayed_start import check_rule
from dilocox.worker.exchange.host_buffers import HostBuffers
from dilocox.worker.exchange.in_flight import InFlight
from dilocox.worker.exchange.loss_watch import LossWatch, watch_round
from dilocox.worker.exchange.outgoing import NextStart, OutgoingFold
from dilocox.worker.exchange.replica_state import resume_summary
from dilocox.worker.exchange.round_report import RoundReport
from dilocox.worker.exchange.run_end import RunEnd
from dilocox.worker.exchange.step_driven import StepDriven

if TYPE_CHECKING:  # torch.distributed.checkpoint: a heavy import, only where a run checkpoints
    from dilocox.worker.checkpoint import SiteCheckpoint

log = structlog.get_logger()


class LocalTrainer(Protocol):
    """What the round loop needs from the local trainer (InnerTrainer, SiteTrainer, or a toy one in tests)."""

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...
    def train_steps(self, n: int) -> tuple[float, int, float]: ...
    def evaluate(self) -> float: ...


def slice_tensors(slices: list[ParamSlice], full: dict[str, torch.Tensor]) -> dict[SliceKey, torch.Tensor]:
    """Cut full tensors into the assignment's slices (views, no copies)."""
    return HostBuffers.slices_of(full, slices)


class DilocoCluster(StepDriven, RunEnd, InFlight):
    def __init__(
        self,
        trainer: LocalTrainer,
        client: AggregatorClient,
        rounds: int,
        inner_steps: int,
        delay: int = 1,
        run_config_json: str = "",
        evaluate_every_round: bool = True,
        access: ParameterAccess | None = None,
        checkpoint: SiteCheckpoint | None = None,
        steps_controller: StepsController | None = None,
        on_round: Callable[[RoundReport, int, int], None] | None = None,
        allow_late_join: bool = True,
        sync_rounds: int = 0,
        delayed_start: str = "own",
        num_clusters: int = 1,
        spill_dir: str = "",
        overlap_steps: int = 0,
        merge_wait: bool = False,
    ) -> None:
        """`access`: how to read and write the parameters this rank exchanges (default: all of the
        trainer's, in this process; a site rank passes `worker.site.access.SiteAccess`).
        `allow_late_join=False`: a cluster new to the run refuses to start once rounds have closed
        (it would train fewer rounds than asked for); a cluster rejoining, or resumed, always may.
        `on_round(report, inner_steps, version)`: called after every round (metrics, progress).
        `sync_rounds`: with the delay, the first rounds run synchronously; `delayed_start` ("own", "eager"
        or "estimate", worker/exchange/delayed_start.py) and `num_clusters` (this cluster's share 1/M of a
        round's mean) decide where a delayed round's successor starts. `spill_dir`: the start lives in a
        file there between boundaries (worker/exchange/spill.py). `overlap_steps` (τ, with the delay): the
        previous round's merged model is taken in from τ inner steps into the next round on, at the first
        step it is back, instead of at its end (`merge_in_flight`; 0, or τ ≥ H: at the boundary — the
        one-step delay of DESIGN.md §3; runs configure 1, `RunConfig.overlap_steps`); `merge_wait`: at step
        τ exactly, waiting for it (deterministic: tests against a reference)."""
        if delay not in (0, 1):
            raise ValueError(f"delay must be 0 or 1, got {delay}")
        self.trainer = trainer
        self.client = client
        self.allow_late_join = allow_late_join
        self.rounds = rounds
        self.inner_steps = inner_steps
        self.delay = delay
        self.sync_rounds = sync_rounds
        self.delayed_start = check_rule(delayed_start)
        if overlap_steps < 0:
            raise ValueError(f"overlap_steps must be ≥ 0, got {overlap_steps}")
        self.overlap_steps = overlap_steps if delayed_start == "own" else 0  # the rebase is the `own` rule
        self.merge_wait = merge_wait
        # taken in mid-round: (exchange, idle, the step, whether it skipped versions), reported at the boundary
        self._merged: tuple[RoundExchange, float, int, bool] | None = None
        self.share = 1.0 / max(1, num_clusters)
        self.run_config_json = run_config_json
        self.evaluate_every_round = evaluate_every_round
        self.access = access or LocalAccess(trainer.named_parameters())
        self.params = getattr(self.access, "params", {})  # one process's parameters by name (tests read them)
        self.names = list(self.access.names)
        self.buffers = HostBuffers(self.access.shapes, pinned=self.access.pinned, spill_dir=spill_dir)
        self.outgoing: OutgoingFold | None = None  # set once the slices are known (`start`)
        self.checkpoint = checkpoint
        self.steps_controller = steps_controller
        # A time box ends its rounds by the clock, checked as the steps run (adaptive_steps.RoundTimeBox);
        # one process agrees with itself, so it checks after every step.
        self.time_box = steps_controller if isinstance(steps_controller, RoundTimeBox) else None
        if self.time_box is not None:
            self.time_box.single_process = isinstance(self.access, LocalAccess)
        self.on_round = on_round
        self.slices: list[ParamSlice] = []
        self.version = -1
        self.reports: list[RoundReport] = []
        self.initial_eval_loss: float | None = None
        self.final_eval_loss: float | None = None
        self.communicator = Communicator(client, pull_names=tuple(self.names), pull_wait_s=client.pull_wait_s)
        self._last_weight = 1.0  # tokens of the last round: the flush round's weight
        self._adopt_held = False  # the last round was synchronous: its θ_T is in the client's copy
        self.flush: dict | None = None  # what the end-of-run flush sent and cost, once it ran
        self._memory_logged = False  # `exchange_memory` is logged once the exchange's state is all there
        self.round = 0  # the round being trained (set by `begin`)
        self.done = False  # the last round and the end of the run are in
        self.stopped_by: str | None = None  # the signal a `run` stopped for
        self._stop = None  # the StopSignal a `run` watches, also while its boundary waits for an exchange
        self._stop_waited = False  # a stop ended a boundary's wait: the exchange in flight had its grace
        self._collected_before_stop: int | None = None
        self.loss_watch = LossWatch()  # the eval of the model each round starts from: spikes, non-finite values
        self._closed = False
        self._reset_round()

    # ------------------------------------------------------------------ parameters
    def current(self) -> dict[str, torch.Tensor]:
        """fp32 host copies of the parameters this rank exchanges (collective in a site)."""
        out = {name: torch.empty(shape) for name, shape in self.access.shapes.items()}
        self.access.read(out)
        return out

    def _slices_of(self, views: dict[str, torch.Tensor]) -> dict[SliceKey, torch.Tensor]:
        return HostBuffers.slices_of(views, self.slices)

    def _start_from_held(self, keep_unsent: bool) -> None:
        """s ← the client's copy of the global weights, minus this cluster's undelivered residual where its
        compressor keeps it locally (`keep_unsent`)."""
        compressor = self.client.compressor
        subtract = keep_unsent and compressor is not None and compressor.keeps_local_residual
        for key, start in self._slices_of(self.buffers.start).items():
            start.copy_(self.client.held[key])
            residual = compressor.residual(key) if subtract else None
            if residual is not None:
                start.sub_(residual.reshape(start.shape))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        """Join, seed uninitialised shards, adopt the current global weights; returns the first round to train."""
        info = self.client.join(self.access.model_specs, self.run_config_json)
        checks = admission_checks(
            self.client.run_id,
            self.rounds,
            self.run_config_json,
            info.run_config_json,
            min(info.versions),
            getattr(self.trainer, "step", 0) == 0,
            info.rejoin,
            self.allow_late_join,
        )
        for refused, error in checks:
            if self.access.agree_any(refused):  # every rank of the site refuses alike
                raise error
        owned = set(self.names)
        self.slices = [s for s in info.assignment if s.name in owned]
        self.outgoing = OutgoingFold(self.buffers, self.slices, self.client.compressor)
        self.access.read(self.buffers.start)  # θ here (the start is set from the shards next): what an
        if info.needs_init:  # uninitialised shard is seeded with
            shards = sorted({s.shard for s in self.slices if s.shard in info.needs_init})
            init = {s.key: s.view(self.buffers.start[s.name]) for s in self.slices if s.shard in shards}
            sent = self.client.push(0, 1.0, init, shards=shards)
            log.info("initialised_shards", shards=shards, bytes_up=sent)
        version, _, received = self.client.pull(min_version=0, names=self.names)
        if self.client.resumed is not None:  # from a checkpoint's replica: only the rounds missed came
            log.info(
                "replica_resumed",
                cluster=self.client.cluster,
                version=version,
                **resume_summary(self.client.resumed, self.client.pull_kinds, received, self.buffers.numel),
            )
        self.version = self.access.agree_min(version)
        self._start_from_held(keep_unsent=False)
        self.access.write(self.buffers.start)
        self.buffers.rest_start()
        self.initial_eval_loss = self.trainer.evaluate()
        log.info(
            "rank_share",
            cluster=self.client.cluster,
            names=self.names,
            params_held=self.access.params_held,
            params_owned=self.buffers.numel,
        )
        log.info(
            "cluster_started",
            cluster=self.client.cluster,
            version=self.version,
            delay=self.delay,
            num_shards=info.num_shards,
            slices=len(self.slices),
            exchange_threads=self.client.exchange_threads,
            eval_loss=round(self.initial_eval_loss, 4),
            bytes_down=received,
        )
        return self.version + 1

    def close_round(self, round_: int, train_loss: float, tokens: int, compute_s: float) -> RoundReport:
        """Round `round_` has been trained (from s_t, the start buffer, as the model held it): fold in the
        network. `tokens`: what the whole site trained this round (the weight of its pseudo-gradient)."""
        began = time.perf_counter() - compute_s
        timer = BoundaryTimer()
        delay = 0 if round_ <= self.sync_rounds else self.delay
        exchange: RoundExchange | None = None
        merged, self._merged = self._merged, None
        idle = merged[1] if merged is not None else 0.0
        refused: AggregatorError | None = None
        if self.communicator.in_flight is not None:  # the previous round's exchange (delayed rounds)
            with timer("collect"):
                exchange, idle, refused = self._collect()
            self._check_stop(exchange)
        self._check_refusal(round_, refused, tokens)
        self._check_tokens_agree(round_, tokens)
        trained = round_
        # The newest version the whole site holds: each rank's is the oldest over its own shards, and the
        # site decides on the oldest of those, so that every rank pushes to the same round and
        # checkpoints into the same folder. (A shard already past it refuses that part: carried, not lost.)
        held = self.access.agree_min(exchange.version if exchange is not None else self.version)
        # A shard that gave any rank the run's final version takes nothing more (and stops once its members
        # have it): the run is over for the whole site even where another shard's answer was older.
        over = self._run_over_without(trained, tokens, max(held, self.client.newest_version))
        round_ = self.rounds if over else self._round_to_push(round_, held)
        # Work pushed to a later round than it was trained for weighs less by its age (and the shards cap
        # it at the on-time contributions' mean): common/wire/staleness.py.
        staleness = round_ - trained
        weight = float(tokens) * stale_discount(staleness, self.client.stale_weighting)
        synchronous = delay == 0 and not over
        if exchange is not None:
            self._commit(exchange.round)
        if not over:  # the state this round ends with, before θ is folded into the residual
            self._capture(round_, timer)
        # θ in, as it arrives: Δ = s − θ into the outgoing buffer and, for a delayed round, the next start
        # s_{t+1} (from θ_{t-1} once a round has come back, else from s_t) — worker/exchange/outgoing.py.
        next_start = None if synchronous else NextStart(self.delayed_start, exchange is not None, self.share)
        assert self.outgoing is not None, "start first"
        folding = self.outgoing.fold(self.client.held, next_start, self.client.outer)
        with timer("read"):
            self.access.read_rows(folding, keep_buffer=self.buffers.spill is None)
        if self.access.agree_any(folding.nonfinite is not None):
            raise ValueError(
                f"pseudo-gradient of {folding.nonfinite or 'another rank'} holds NaN or Inf: round {trained} not sent"
            )
        outgoing = self.outgoing.outgoing_slices()
        if synchronous:
            self.communicator.submit(round_, weight, outgoing, facts=(self.inner_steps, idle, staleness), formed=True)
            with timer("collect"):
                exchange, waited, refused = self._collect()
            self._check_stop(exchange)
            idle += waited
            self._check_refusal(round_, refused, tokens)
            self._commit(round_)
            with timer("start"):
                self._start_from_held(keep_unsent=True)
        elif not over:
            self.communicator.submit(round_, weight, outgoing, facts=(self.inner_steps, idle, staleness), formed=True)
        # A boundary that skipped versions (the site caught up on rounds closed without it) starts its model
        # from weights rounds newer than the ones it trained on: its own eval may jump for a round.
        caught_up = round_ != trained or (exchange is not None and exchange.version > self.version + 1)
        caught_up = caught_up or (merged is not None and merged[3])
        reported = exchange or (merged[0] if merged is not None else None)  # what this round's figures show
        if exchange is not None:
            self.version = exchange.version
        if self.time_box is not None:  # a late site's next box is shorter, to get back in phase
            self.time_box.late = self.access.agree_any(bool(reported is not None and reported.late))
        self._adopt_held = over or (delay == 0 and round_ == self.rounds)
        self._last_weight = float(tokens)
        with timer("write"):
            self.access.write(self.buffers.start)
        self.buffers.rest_start()  # a spilled start goes back to disk while the next round trains
        with timer("eval"):
            eval_loss = self.trainer.evaluate() if self.evaluate_every_round or round_ == self.rounds else float("nan")
        comm_s = reported.comm_s if reported else 0.0
        report = RoundReport(
            round=round_,
            train_loss=round(train_loss, 4),
            eval_loss=round(eval_loss, 4),
            tokens=tokens,
            bytes_up=reported.bytes_up if reported else 0,
            bytes_down=reported.bytes_down if reported else 0,
            compute_s=round(compute_s, 3),
            comm_s=round(comm_s, 3),
            idle_s=round(idle, 3),
            seconds=round(time.perf_counter() - began, 3),
            overlap=round(min(1.0, max(0.0, 1.0 - idle / comm_s)), 3) if comm_s > 0 else 1.0,
            residual_norm=round(self.client.compressor.residual_norm(), 4) if self.client.compressor else 0.0,
            compress_rank=round(self.client.compressor.mean_rank(), 2) if self.client.compressor else 0.0,
            inner_steps=self.inner_steps,
            late=bool(reported and reported.late),
            merged_at_step=merged[2]
            if merged is not None
            else (self.inner_steps if exchange is not None and not synchronous else 0),
        )
        self._watch_losses(report, evaluated=self.evaluate_every_round or round_ == self.rounds, caught_up=caught_up)
        log.info("round_done", cluster=self.client.cluster, delay=delay, **asdict(report))
        log.info("boundary_done", round=round_, rss_before_mb=timer.rss_before_mb, **timer.seconds())
        if not self._memory_logged and round_ > 1:
            self._log_memory()
        if self.on_round is not None:
            self.on_round(report, self.inner_steps, self.version)
        if self.steps_controller is not None:  # the same H on every rank of a site: the slowest rank's
            self.steps_controller.steps = self.inner_steps  # what was trained (agreed), which the rate is over
            self.inner_steps = self.access.agree_min(self.steps_controller.update(round_, compute_s, comm_s))
        if round_ != trained:
            log.warning(
                "round_caught_up",
                cluster=self.client.cluster,
                trained=trained,
                pushed=round_,
                version=self.version,
                staleness=staleness,
                tokens=tokens,
                weight=round(weight, 3),
                reason="the shards closed the rounds in between without this site: its work goes to the open round",
            )
        return report

    def _watch_losses(self, report: RoundReport, evaluated: bool, caught_up: bool = False) -> None:
        """The round's losses through the site's loss watch (worker/exchange/loss_watch.py: `watch_round`)."""
        watch_round(
            self.loss_watch,
            report,
            self.client.cluster,
            self.trainer,
            evaluated,
            caught_up,
            train_loss_given=bool(self._loss_steps),
        )

    def _log_memory(self) -> None:
        self._memory_logged = True
        log_exchange_memory(self.client, self.buffers, self.access.params_held)

    def _capture(self, round_: int, timer: BoundaryTimer) -> None:
        """Start the checkpoint of the state round `round_` ends with, before its pseudo-gradient leaves."""
        if self.checkpoint is not None:
            with timer("checkpoint"):
                self.checkpoint.capture(round_, self.trainer, self.client.compressor, self.names, client=self.client)

    def _commit(self, round_: int) -> None:
        """Round `round_` is on the shards: its checkpoint becomes the one to resume from. A restart thus
        resumes exactly at a round the shards have — no inner step lost or repeated."""
        if self.checkpoint is not None:
            self.checkpoint.commit(round_)
