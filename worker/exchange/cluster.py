"""The outer loop of one cluster: DiLoCo rounds against the sharded aggregation service.

Both forms of DESIGN.md §3, one loop:

* ``delay=0`` (synchronous DiLoCo, the reference): train H steps from s_t = θ_{t-1}; send
  Δ_t = s_t − θ_local; wait for θ_t; adopt it; s_{t+1} = θ_t.
* ``delay=1`` (DiLoCoX one-step delay): train H steps from s_t; Δ_t = s_t − θ_local; collect θ_{t-1}
  (it travelled while round t computed); θ_local ← θ_{t-1} − Δ_t (the merged model with this round's
  own progress on top); s_{t+1} = θ_local; hand Δ_t to the background communicator. For the first round
  nothing is in flight and θ_{t-1} is s_t itself, so the same rule holds. After the last round the
  cluster collects θ_T.

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
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict
from typing import Callable, Protocol

import grpc
import structlog
import torch

from dilocox.common.config.run import final_version_of
from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.framing import SliceKey
from dilocox.worker.exchange.adaptive_steps import StepsController
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError
from dilocox.worker.exchange.communicator import Communicator, RoundExchange
from dilocox.worker.exchange.delayed_start import check_rule, start_rule
from dilocox.worker.exchange.round_report import RoundReport
from dilocox.worker.local_checkpoint import WorkerCheckpoint

log = structlog.get_logger()


class LocalTrainer(Protocol):
    """What the round loop needs from the local trainer (InnerTrainer, or a toy one in tests)."""

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]: ...
    def train_steps(self, n: int) -> tuple[float, int, float]: ...
    def evaluate(self) -> float: ...


def slice_tensors(slices: list[ParamSlice], full: dict[str, torch.Tensor]) -> dict[SliceKey, torch.Tensor]:
    """Cut full tensors into the assignment's slices (views, no copies)."""
    return {s.key: s.view(full[s.name]) for s in slices if s.name in full}


class RunFinished(RuntimeError):
    """The shards already hold the run's final version: a cluster that starts now has nothing to train."""


class LateJoin(RuntimeError):
    """A cluster new to the run arrives after rounds have closed: it would train fewer than it asked for."""


class DilocoCluster:
    def __init__(
        self,
        trainer: LocalTrainer,
        client: AggregatorClient,
        rounds: int,
        inner_steps: int,
        delay: int = 1,
        run_config_json: str = "",
        evaluate_every_round: bool = True,
        model_specs: list[tuple[str, tuple[int, ...]]] | None = None,
        owned_names: list[str] | None = None,
        peer_sync: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
        checkpoint: WorkerCheckpoint | None = None,
        steps_controller: StepsController | None = None,
        on_round: Callable[[RoundReport, int, int], None] | None = None,
        allow_late_join: bool = True,
        sync_rounds: int = 0,
        delayed_start: str = "own",
        num_clusters: int = 1,
    ) -> None:
        """`model_specs`: the whole model's (name, shape) list, when this rank holds only a stage of it.
        `allow_late_join=False`: a cluster new to the run refuses to start once rounds have closed
        (it would train fewer rounds than asked for); a cluster rejoining, or resumed, always may.
        `owned_names`: the parameters this rank pushes and pulls (its replica's share of the stage).
        `peer_sync`: fills in the global weights of the stage's other names from the replicas that
        pulled them (a broadcast over the stage's data-parallel group).
        `on_round(report, inner_steps, version)`: called after every round, e.g. to update metrics.
        `sync_rounds`: with the delay, the first rounds run synchronously; `delayed_start` ("own" or
        "eager", worker/exchange/delayed_start.py) and `num_clusters` (this cluster's share 1/M of a
        round's mean) decide where a delayed round's successor starts."""
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
        self.share = 1.0 / max(1, num_clusters)
        self.run_config_json = run_config_json
        self.evaluate_every_round = evaluate_every_round
        self.params = dict(trainer.named_parameters())
        self.model_specs = model_specs or [(name, tuple(p.shape)) for name, p in self.params.items()]
        self.owned_names = list(owned_names) if owned_names is not None else list(self.params)
        self.peer_sync = peer_sync
        self.checkpoint = checkpoint
        self.steps_controller = steps_controller
        self.on_round = on_round
        self._captured: dict[int, tuple[dict, dict | None]] = {}  # round -> local state, until it is on the shards
        self.slices: list[ParamSlice] = []
        self.version = -1
        self.reports: list[RoundReport] = []
        self.initial_eval_loss: float | None = None
        self.final_eval_loss: float | None = None
        self.communicator = Communicator(client, pull_names=tuple(self.owned_names))
        self._last_weight = 1.0  # tokens of the last round: the flush round's weight
        self._last_round_weights: dict[SliceKey, torch.Tensor] | None = None  # θ_T pulled by the synchronous last round
        self.flush: dict | None = None  # what the end-of-run flush sent and cost, once it ran

    # ------------------------------------------------------------------ parameters
    def current(self) -> dict[str, torch.Tensor]:
        """fp32 CPU copies of the local parameters (a snapshot that later steps do not touch). The
        exchange works on the CPU in fp32 whatever device the trainer uses: pseudo-gradients, error
        feedback and the replica of the outer step never depend on the accelerator."""
        return {name: p.detach().to(device="cpu", dtype=torch.float32, copy=True) for name, p in self.params.items()}

    def _assign(self, full: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in full.items():
                self.params[name].copy_(tensor)

    def _global_weights(self, pulled: dict[SliceKey, torch.Tensor], keep_unsent: bool = False,
                        then: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """Full tensors of the pulled global weights of this rank's parameters (every slice must be
        present); with `peer_sync`, completed by the stage's replicas.

        `keep_unsent`: minus this cluster's undelivered residual where its compressor keeps it locally
        (error feedback with `local_residual`): the weights to train on are the global model plus all
        of this cluster's own progress the global model does not hold yet. Taken off before the
        replicas' broadcast, so every replica of a stage gets the same weights; so is `then` (the
        delayed start, which needs this rank's momentum)."""
        by_key = {s.key: s for s in self.slices}
        missing = set(by_key) - set(pulled)
        if missing:
            raise RuntimeError(f"pull returned no weights for {len(missing)} slices, e.g. {sorted(missing)[0]}")
        full = {name: torch.empty_like(self.params[name], device="cpu") for name in self.owned_names}
        for key, tensor in pulled.items():
            if key in by_key:
                s = by_key[key]
                s.view(full[s.name]).copy_(tensor)
        compressor = self.client.compressor
        if keep_unsent and compressor is not None and compressor.keeps_local_residual:
            for s in self.slices:
                residual = compressor.residual(s.key)
                if residual is not None:
                    s.view(full[s.name]).sub_(residual.reshape(s.slice_shape))
        if then is not None:
            full = then(full)
        return self.peer_sync(full) if self.peer_sync else full

    def _next_start(self, delta: dict[str, torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """The delayed round's successor start from θ_{t-1} (this rank's names), by `delayed_start`."""
        return start_rule(self.delayed_start, delta, self.slices, self.client.outer, self.share)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        """Join, seed uninitialised shards, adopt the current global weights; returns the first round to train."""
        info = self.client.join(self.model_specs, self.run_config_json)
        final = final_version_of(info.run_config_json)
        if final is not None and min(info.versions) >= final and getattr(self.trainer, "step", 0) == 0:
            raise RunFinished(
                f"run {self.client.run_id!r} has finished: the shards hold its final version {min(info.versions)} "
                f"({final} = its rounds and the end-of-run flush), so this cluster would train nothing. Get the model "
                "with `dilocox export`, or start a new run (another --run-id, fresh shards)"
            )
        held, fresh = min(info.versions), getattr(self.trainer, "step", 0) == 0
        if not self.allow_late_join and not info.rejoin and fresh and held > 0:
            raise LateJoin(
                f"run {self.client.run_id!r} is at version {held}: its first {min(held, self.rounds)} rounds have closed, so "
                f"this site would train {max(0, self.rounds - held)} of its {self.rounds} rounds. Start every site together "
                "(shards first, --min-clusters = the number of sites), or pass --join-late to join anyway"
            )
        owned = set(self.owned_names)
        self.slices = [s for s in info.assignment if s.name in owned]
        if info.needs_init:
            shards = sorted({s.shard for s in self.slices if s.shard in info.needs_init})
            init = slice_tensors([s for s in self.slices if s.shard in shards], self.current())
            sent = self.client.push(0, 1.0, init, shards=shards)
            log.info("initialised_shards", shards=shards, bytes_up=sent)
        self.version, pulled, received = self.client.pull(min_version=0, names=self.owned_names)
        self._assign(self._global_weights(pulled))
        self.initial_eval_loss = self.trainer.evaluate()
        log.info("rank_share", cluster=self.client.cluster, names=self.owned_names,
                 params_held=sum(p.numel() for p in self.params.values()))  # fmt: skip
        log.info(
            "cluster_started",
            cluster=self.client.cluster,
            version=self.version,
            delay=self.delay,
            num_shards=info.num_shards,
            slices=len(self.slices),
            eval_loss=round(self.initial_eval_loss, 4),
            bytes_down=received,
        )
        return self.version + 1

    def run_round(self, round_: int, start: dict[str, torch.Tensor]) -> tuple[RoundReport, dict[str, torch.Tensor]]:
        """Train one round from `start` (s_t) and fold in the network; returns the report and s_{t+1}."""
        began = time.perf_counter()
        train_loss, tokens, compute_s = self.trainer.train_steps(self.inner_steps)
        local = self.current()
        delta = {name: start[name] - local[name] for name in local}

        exchange: RoundExchange | None = None
        idle = 0.0
        delay = 0 if round_ <= self.sync_rounds else self.delay
        if delay == 0:
            self._capture(round_)
            self.communicator.submit(round_, float(tokens), slice_tensors(self.slices, delta))
            exchange, idle = self.communicator.collect()
            self._commit(round_)
            merged = self._global_weights(exchange.weights, keep_unsent=True)
        else:
            if self.communicator.in_flight is not None:
                exchange, idle = self._collect_or_drop(round_, tokens)
                self._commit(exchange.round)
                merged = self._global_weights(exchange.weights, keep_unsent=True, then=self._next_start(delta))
            else:  # nothing in flight: θ_{t-1} is where this round started
                owned = self._next_start(delta)({name: start[name] for name in self.owned_names})
                merged = self.peer_sync(owned) if self.peer_sync else owned
            self._capture(round_)
            self.communicator.submit(round_, float(tokens), slice_tensors(self.slices, delta))
        if exchange is not None:
            self.version = exchange.version
            if round_ == self.rounds and delay == 0:
                self._last_round_weights = exchange.weights
        self._last_weight = float(tokens)
        self._assign(merged)

        eval_loss = self.trainer.evaluate() if self.evaluate_every_round or round_ == self.rounds else float("nan")
        comm_s = exchange.comm_s if exchange else 0.0
        report = RoundReport(
            round=round_,
            train_loss=round(train_loss, 4),
            eval_loss=round(eval_loss, 4),
            tokens=tokens,
            bytes_up=exchange.bytes_up if exchange else 0,
            bytes_down=exchange.bytes_down if exchange else 0,
            compute_s=round(compute_s, 3),
            comm_s=round(comm_s, 3),
            idle_s=round(idle, 3),
            seconds=round(time.perf_counter() - began, 3),
            overlap=round(min(1.0, max(0.0, 1.0 - idle / comm_s)), 3) if comm_s > 0 else 1.0,
            residual_norm=round(self.client.compressor.residual_norm(), 4) if self.client.compressor else 0.0,
        )
        log.info("round_done", cluster=self.client.cluster, delay=delay, inner_steps=self.inner_steps, **asdict(report))
        if self.on_round is not None:
            self.on_round(report, self.inner_steps, self.version)
        if self.steps_controller is not None and exchange is not None:
            self.inner_steps = self.steps_controller.update(round_, compute_s, exchange.comm_s)
        return report, merged

    def _collect_or_drop(self, round_: int, tokens: int) -> tuple[RoundExchange, float]:
        """Collect the previous round's exchange; if the shards refused it, round `round_`, trained
        meanwhile on top of it, is discarded (the cluster rejoins and adopts the global weights): counted
        and logged, so no computed round disappears silently. (What the refusing shard lacked of the
        previous round is carried into the next push by the client.)"""
        try:
            return self.communicator.collect()
        except AggregatorError as error:
            if error.code == grpc.StatusCode.FAILED_PRECONDITION:
                self.client.traffic.dropped_rounds += 1
                self.client.traffic.dropped_tokens += int(tokens)
                log.warning("local_round_dropped", cluster=self.client.cluster, round=round_, tokens=int(tokens),
                            reason=error.details)  # fmt: skip
            raise

    def _capture(self, round_: int) -> None:
        """Copy the local state that round `round_` ends with, before its pseudo-gradient leaves."""
        if self.checkpoint is not None:
            compressor = self.client.compressor
            self._captured[round_] = (copy.deepcopy(self.trainer.state_dict()),
                                      copy.deepcopy(compressor.state_dict()) if compressor else None)  # fmt: skip

    def _commit(self, round_: int) -> None:
        """Round `round_` is on the shards: its captured state becomes the checkpoint. A restart thus
        resumes exactly at a round the shards have — no inner step lost or repeated."""
        captured = self._captured.pop(round_, None)
        for older in [r for r in self._captured if r < round_]:
            del self._captured[older]
        if captured is not None and round_ % self.checkpoint.every == 0:
            self.checkpoint.write(round_, *captured)

    def finish(self) -> None:
        """End on the global model, the same in both forms: collect θ_T (delay=1: it is still in flight),
        flush the error-feedback residuals, and adopt the shards' weights without any local residual."""
        weights = self._last_round_weights
        if self.communicator.in_flight is not None:
            exchange, idle = self.communicator.collect()
            self._commit(exchange.round)
            self.version = exchange.version
            weights = exchange.weights
            log.info("last_round_collected", cluster=self.client.cluster, version=exchange.version, idle_s=round(idle, 3),
                     bytes_up=exchange.bytes_up, bytes_down=exchange.bytes_down)  # fmt: skip
        flushed = self._flush_residuals()
        if flushed is not None:
            weights = flushed.weights
        if weights is not None:
            self._assign(self._global_weights(weights))
            log.info("final_weights_adopted", cluster=self.client.cluster, version=self.version)

    def _flush_residuals(self) -> RoundExchange | None:
        """Round `rounds + 1` without inner steps: a zero pseudo-gradient pushed with the dense flush
        codec, so that error feedback sends exactly what the compressed rounds held back. Returns its
        exchange, or None when nothing is to be flushed or the shards have already closed that round
        without it. (A worker resumed after its run had ended finds its own flush in that round: the
        shards answer the repeated push as a duplicate and it ends on their model.)"""
        compressor = self.client.compressor
        if compressor is None or not compressor.flushes:
            return None
        round_ = self.rounds + 1
        held_back = compressor.residual_norm()
        zeros = {s.key: torch.zeros(s.slice_shape) for s in self.slices}  # on the CPU, where Δ lives
        self.communicator.submit(round_, self._last_weight, zeros, codec=compressor.config.flush_codec)
        try:
            exchange, idle = self.communicator.collect()
        except AggregatorError as error:
            if error.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("residuals_not_flushed", cluster=self.client.cluster, round=round_, reason=error.details)
            return None
        self.version = exchange.version
        self.flush = {"round": round_, "codec": compressor.config.flush_codec, "residual_norm": round(held_back, 4),
                      "bytes_up": exchange.bytes_up, "bytes_down": exchange.bytes_down, "comm_s": round(exchange.comm_s, 3)}  # fmt: skip
        log.info("residuals_flushed", cluster=self.client.cluster, version=exchange.version, idle_s=round(idle, 3), **self.flush)
        return exchange

    def run(self) -> list[RoundReport]:
        try:
            round_ = self.start()
            start = self.current()
            while round_ <= self.rounds:
                try:
                    report, start = self.run_round(round_, start)
                except AggregatorError as error:
                    if error.code != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    # The shards went on without us (a missed deadline made us inactive, or our round
                    # closed): rejoin, adopt the current global weights and carry on from there.
                    log.warning("cluster_rejoining", cluster=self.client.cluster, round=round_, reason=error.details)
                    self.communicator.close(timeout=0)
                    self.communicator = Communicator(self.client, pull_names=tuple(self.owned_names))
                    round_ = self.start()
                    start = self.current()
                    continue
                self.reports.append(report)
                round_ += 1
            self.finish()
        finally:
            pending = self.communicator.in_flight
            outcome = self.communicator.close()
            log.info("communicator_closed", cluster=self.client.cluster, outcome=outcome, round=pending)
            if outcome == "completed" and pending is not None:
                self._commit(pending)  # its exchange made it: that round is durable now
        self.final_eval_loss = self.trainer.evaluate() if self.reports else self.initial_eval_loss
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
        return self.reports
