"""`dilocox.DiLoCoX`: one site of a run, driven by the user's own training loop.

The user keeps their model, inner optimizer, schedule, loss and data order; after every inner step they
call `step(tokens=…)`. Every `config.inner.steps` (H) steps that call closes a round exactly as
`dilocox worker` does — the CLI's worker is this same object over its built-in trainer — so the delay,
compression, replay, replay check, carry and rejoin are the same code:

    with DiLoCoX(model, servers="10.0.0.5:50051", config=config, cluster="site-a") as dx:
        while not dx.done:
            loss = train_one_step(model, optimizer, batch)      # the user's step
            dx.step(tokens=batch.numel(), loss=loss)

Why an explicit call per step rather than a hook on the optimizer's `step()` (torchft's way): the round's
pseudo-gradient is weighted by the tokens the site trained, which only the loop knows; a skipped AMP
step or gradient accumulation changes what a "step" is; and a visible call is where the model's weights
may change (at a sync). `hook(optimizer, tokens_per_step)` is there for loops where a fixed count holds.

A model in one process is read and written directly; a site of several ranks (FSDP2-sharded, pipeline
stages, under torchrun) passes its `SiteMesh`, and each rank exchanges the parameters it owns.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from dilocox.common.config.run import RunConfig, as_dict
from dilocox.common.config.waits import PULL_WAIT_S, SHARD_WAIT_S, collective_timeout_for
from dilocox.common.security import TlsFiles
from dilocox.common.wire.assignment import tokenizer_digest_of
from dilocox.common.wire.compression import TensorCompressor
from dilocox.model_access import access_for
from dilocox.worker.exchange.access import ParameterAccess
from dilocox.worker.exchange.adaptive_steps import steps_controller_for
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import DilocoCluster
from dilocox.worker.exchange.packed_state import compressor_state_by_name, pack, restore_compressor_state
from dilocox.worker.exchange.round_report import RoundReport
from dilocox.worker.exchange.stop import StopSignal

if TYPE_CHECKING:  # torch.distributed's mesh: imported where a site of several ranks makes one
    from torch.distributed.device_mesh import DeviceMesh

    from dilocox.worker.site.mesh import SiteMesh

log = structlog.get_logger()

STATE_FORMAT = "dilocox-site-state/2"  # exchange: packed state per owned parameter name
LEGACY_STATE_FORMAT = "dilocox-site-state/1"  # exchange: unpacked state per slice key


@dataclass
class BuiltinTrainer:
    """What `dilocox worker` adds for its own trainer (not part of the stable API): the trainer (its
    `train_steps` and `evaluate`, and the state its DCP checkpoint saves), the parameter access it built,
    that checkpoint and adaptive H. `DiLoCoX.run_builtin` drives it."""

    trainer: object
    access: ParameterAccess
    checkpoint: object | None = None
    steps_controller: object | None = None


class _UserLoop:
    """The `LocalTrainer` side of a user's loop: their eval (if any) and whether the site has trained yet."""

    def __init__(self, evaluate: Callable[[], float] | None) -> None:
        self._evaluate = evaluate
        self.step = 0  # > 0 once a state_dict is loaded: the site is not new to its run

    def evaluate(self) -> float:
        return float(self._evaluate()) if self._evaluate is not None else float("nan")


def tokenizer_identity(tokenizer: object) -> tuple[str, str]:
    """(digest, tokenizer.json) the shards record and check: None → nothing sent; "byte" → bytes as tokens;
    a (digest, tokenizer.json) pair as this returns; a path to a tokenizer.json (or its folder); or a Hugging Face
    tokenizer object (`tokenizers.Tokenizer`
    or a fast `transformers` tokenizer)."""
    if tokenizer is None:
        return "", ""
    if isinstance(tokenizer, tuple):  # already (digest, definition)
        return tokenizer
    if tokenizer == "byte":
        return "byte", ""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        with open(path, encoding="utf-8") as f:
            definition = f.read()
    else:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "to_str"):
            raise TypeError(
                "tokenizer must be None, 'byte', a tokenizer.json path or a Hugging Face tokenizer, got "
                f"{type(tokenizer).__name__}"
            )
        definition = backend.to_str()
    return tokenizer_digest_of(definition), definition


class DiLoCoX:
    """One site of a DiLoCoX run on this rank, driven by the caller's loop (see the module docstring and
    docs/api.md)."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        *,
        servers: str | Sequence[str],
        config: RunConfig | None = None,
        cluster: str = "cluster-0",
        num_clusters: int = 1,
        mesh: SiteMesh | DeviceMesh | None = None,
        evaluate: Callable[[], float] | None = None,
        tokenizer: object = None,
        tls: TlsFiles | None = None,
        token: str | None = None,
        shard_wait_s: float = SHARD_WAIT_S,
        pull_wait_s: float = PULL_WAIT_S,
        join_late: bool = False,
        on_round: Callable[[RoundReport], None] | None = None,
        builtin: BuiltinTrainer | None = None,
    ) -> None:
        """`model`: the site's model on this rank — a plain module, or (with `mesh`) an FSDP2-sharded one or
        a pipeline stage; its parameters are what the site exchanges. `servers`: the shards' host:port
        (a comma-separated string or a list). `config`: the run's configuration (`RunConfig`, or
        `load_run_config("run.toml")`; the same as the CLI's — rounds, H = `inner.steps`, delay,
        compression, the wire); every site of a run must give the same. `cluster`: this site's name,
        unique in the run. `num_clusters`: how many sites the run has (the delayed start's share 1/M).
        `mesh`: a `SiteMesh` when this rank is one of a torchrun site's, or the job's own `DeviceMesh`
        (torchtitan's: dimensions pp, dp_replicate, dp_shard; `SiteMesh.adopt` reads it). `evaluate`: returns the
        model's
        eval loss (called after joining, after each round and at the end; optional). `tokenizer`: what
        the shards check every site tokenizes with (see `tokenizer_identity`). `tls`, `token`: as the
        CLI's `--tls-*` and `--token`. `shard_wait_s`: how long an unreachable shard is waited for;
        `pull_wait_s`: a round's result (a `SiteMesh`'s collective timeout must outlast both:
        `collective_timeout_for`).
        `join_late`: join a run whose first rounds have closed. `on_round(report)`: after each round.
        `builtin`: used by `dilocox worker` for its own trainer; not for user code."""
        self.config = config or RunConfig()
        self.cluster_name = cluster
        if mesh is not None:
            from torch.distributed.device_mesh import DeviceMesh as _DeviceMesh

            if isinstance(mesh, _DeviceMesh):  # the job's own (torchtitan's): its layout, DiLoCoX's groups over it
                from dilocox.worker.site.mesh import SiteMesh as _SiteMesh

                # DiLoCoX's own groups (agreements, checkpoint writer) outlast one rank's longest exchange wait.
                mesh = _SiteMesh.adopt(mesh, self.config.parallel, collective_timeout_for(shard_wait_s, pull_wait_s))
            elif mesh.collective_timeout_s < collective_timeout_for(shard_wait_s, pull_wait_s, margin_s=0):
                log.warning(
                    "site_collective_timeout_short",
                    collective_timeout_s=mesh.collective_timeout_s,
                    needed_s=collective_timeout_for(shard_wait_s, pull_wait_s),
                    reason="a rank waiting for a round's result or a shard can outlast it while its peers wait in "
                    "an agreement; build the SiteMesh with collective_timeout_for(shard_wait_s, pull_wait_s)",
                )
        self.mesh = mesh
        addresses = (
            [a.strip() for a in servers.split(",")] if isinstance(servers, str) else [a.strip() for a in servers]
        )
        addresses = [a for a in addresses if a]
        if not addresses:
            raise ValueError("servers: give the host:port of every shard")
        if builtin is None:
            if model is None:
                raise ValueError("model: give the module this site trains")
            trainer: object = _UserLoop(evaluate)
            access = access_for(model, self.mesh, self.cluster_name)
            from dilocox.worker.site.memory_plan import exchange_bytes_per_param
            from dilocox.worker.site.size_guard import check_exchange_host  # the plan's bytes per exchanged parameter

            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) if mesh is not None else 1
            check_exchange_host(
                sum(math.prod(shape) for shape in access.shapes.values()),
                local,
                per_param=exchange_bytes_per_param(self.config.parallel),
            )
        else:
            trainer, access = builtin.trainer, builtin.access
        self.access = access
        compress = self.config.compress
        self.compressor = (
            TensorCompressor(compress, seed=self.config.seed, name="uplink") if compress.codec != "fp32" else None
        )
        self.client = AggregatorClient(
            addresses,
            self.config.run_id,
            cluster,
            self.config.wire,
            compressor=self.compressor,
            stale_weighting=self.config.stale_weighting,
            tls=tls,
            token=token,
            shard_wait_s=shard_wait_s,
            pull_wait_s=pull_wait_s,
            tokenizer=tokenizer_identity(tokenizer),
        )
        self.cluster = DilocoCluster(
            trainer,
            self.client,
            self.config.rounds,
            self.config.inner.steps,
            self.config.delay,
            json.dumps(as_dict(self.config)),
            access=access,
            allow_late_join=join_late,
            sync_rounds=self.config.sync_rounds,
            delayed_start=self.config.delayed_start,
            overlap_steps=self.config.overlap_steps,
            num_clusters=num_clusters,
            spill_dir=self.config.parallel.spill_dir,
            on_round=(lambda report, _h, _v: on_round(report)) if on_round else None,
            checkpoint=builtin.checkpoint if builtin else None,
            steps_controller=builtin.steps_controller
            if builtin
            else steps_controller_for(self.config.inner, single_process=False),
        )
        self._started = False
        self._closed = False
        self._hooks: list = []

    # ------------------------------------------------------------------ the loop
    def start(self) -> DiLoCoX:
        """Join the run and load the global model into `model` (first round: every site starts from the same
        θ_0, seeded by the first site to arrive). Called by `with` and by the first `step` if not before."""
        if not self._started:
            self._started = True
            self.cluster.begin()
        return self

    def step(self, tokens: int, loss: float | torch.Tensor | None = None, steps: int = 1) -> RoundReport | None:
        """`steps` inner steps (optimizer steps) were just taken, on `tokens` tokens across this site
        (every rank of a site passes the same); `loss` their mean training loss (optional; a tensor is
        read only at the sync). At the round's last step the site syncs: the model's weights change to
        the next round's start, and the round's report is returned (None otherwise). The weights also
        change at the step, early in a round, where the previous round's merged update is taken in
        (`overlap_steps`): the merged model with this round's steps so far on top."""
        self.start()
        return self.cluster.after_steps(steps, tokens, loss)

    def run_builtin(self, stop: StopSignal | None = None) -> list[RoundReport]:
        """`dilocox worker`: drive the built-in trainer H steps at a time through the same rounds as `step`
        (`stop`: leave between steps once a SIGTERM came, worker/exchange/stop.py)."""
        self._started = True
        try:
            return self.cluster.run(stop)
        finally:
            self.close()

    def hook(self, optimizer: torch.optim.Optimizer, tokens_per_step: int) -> None:
        """Call `step(tokens_per_step)` after every `optimizer.step()` (for loops with a fixed batch)."""
        self._hooks.append(
            optimizer.register_step_post_hook(lambda *_: None if self.done else self.step(tokens_per_step))
        )

    @property
    def done(self) -> bool:
        """The last round and the end of the run are in: `model` holds the run's final global weights."""
        return self.cluster.done

    @property
    def steps_to_sync(self) -> int:
        """Inner steps to take before the site next syncs or merges (1 while it waits for the previous
        round's update to come back, from `overlap_steps` on)."""
        return self.cluster.steps_to_sync

    @property
    def round(self) -> int:
        """The round being trained (1-based; valid after `start`)."""
        return self.cluster.round

    @property
    def reports(self) -> list[RoundReport]:
        return self.cluster.reports

    @property
    def final_eval_loss(self) -> float | None:
        return self.cluster.final_eval_loss

    def close(self) -> None:
        """Finish (or abandon, after 30 s) the exchange in flight and release the connections. A site that
        stops before `done` resumes later from its `state_dict()` (or rejoins fresh)."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        try:
            self.cluster.close()
        finally:
            self.client.close()

    def __enter__(self) -> DiLoCoX:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The DiLoCoX side of a checkpoint, to save beside the model and optimizer: the error-feedback
        residuals (and the compressor's warm starts) of the parameters this rank exchanges, the round and
        the site's position in it. Waits for the pseudo-gradient in flight to be sent (not for its
        round's result), so the residuals match what the shards have. With them, the replica of the
        global model (weights, outer momentum, each shard's version): a resumed site pulls only the
        rounds it missed, where the shards still keep them, checked by the replay check's digest
        (worker/exchange/replica_state.py).

        `exchange` and `replica` hold one bytes object per parameter this rank owns, keyed by its name
        (empty state packed where there is none yet), so the same call on a fresh site — before `start` —
        is a template `torch.distributed.checkpoint` can load every rank's part into
        (worker/exchange/packed_state.py)."""
        if self._started:
            self.cluster.communicator.wait_pushed()
        return {
            "format": STATE_FORMAT,
            "run_id": self.config.run_id,
            "cluster": self.cluster_name,
            "round": self.cluster.round,
            "version": self.cluster.version,
            "steps_in_round": self.cluster.steps_in_round,
            "exchange": compressor_state_by_name(self.compressor, self.cluster.names),
            "replica": self.client.replica_state(self.cluster.names),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` (before `start`). The site rejoins as itself: the shards say which
        round to train and the model gets their global weights (inner steps taken since the last sync are
        trained again), by replaying the rounds it missed on the saved replica where the shards keep them;
        its residuals carry on where they were."""
        if self._started:
            raise RuntimeError("load_state_dict must come before start() (or the with-block, or the first step)")
        if state.get("format") not in (STATE_FORMAT, LEGACY_STATE_FORMAT):
            raise ValueError(f"not a DiLoCoX site state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        if state.get("run_id") != self.config.run_id:
            raise ValueError(f"this state is run {state.get('run_id')!r}'s, not {self.config.run_id!r}'s")
        if self.compressor is not None:
            owned = list(self.cluster.names)
            exchange = state.get("exchange", {})
            if state["format"] == LEGACY_STATE_FORMAT:  # keyed by slice, unpacked
                exchange = {name: pack({k: v for k, v in exchange.items() if k.name == name}) for name in owned}
            missing = restore_compressor_state(self.compressor, exchange, owned)
            if missing and self.compressor.config.error_feedback and int(state.get("round", 1)) > 1:
                log.warning(
                    "site_state_residuals_missing",
                    cluster=self.cluster_name,
                    round=state.get("round"),
                    parameters=len(missing),
                    of=len(owned),
                    example=missing[0],
                    reason="the state holds no error-feedback residual for them (saved by another layout, or "
                    "loaded through a template without their keys): they start from none",
                )
        self.client.restore_replica(state.get("replica", {}), list(self.cluster.names))  # installed at the join
        if isinstance(self.cluster.trainer, _UserLoop):
            self.cluster.trainer.step = max(1, int(state.get("round", 1)))
        log.info(
            "site_state_loaded",
            cluster=self.cluster_name,
            round=state.get("round"),
            residuals=len(self.compressor.state) if self.compressor is not None else 0,
        )
