"""The sim's view of the global model: evaluated at every version the shards publish.

The sim used to print a line per round only once *every* cluster had reported it, with the mean of the
clusters' own evals — replicas that, under quorum + grace, include a stale one: an uneven run showed 3 of
6 rounds and a loss that seemed to rise while the global model was fine. This watch reads the shards'
weights as an observer (no membership: no round waits for it) each time a version is published, and
evaluates them on the run's eval split, in the sim's own process. A round's eval is then the global
model's, whichever sites made it; a jump past `SPIKE_RATIO` × the best so far, or a non-finite loss, is
logged as a warning (`global_eval_spike`, `global_eval_rising`, `global_eval_nonfinite`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import structlog
import torch

from dilocox.common.config.run import RunConfig
from dilocox.common.security import TlsFiles
from dilocox.worker.data.corpus import evaluate_run
from dilocox.worker.data.token_data import TokenData
from dilocox.worker.exchange.loss_watch import LossWatch
from dilocox.worker.export.model import ExportError, from_servers
from dilocox.worker.models.build import build_model

log = structlog.get_logger()


class GlobalEvalWatch:
    """A thread that evaluates versions 1..`last_version` of the shards' model as they are published;
    `on_eval(version, loss)` is called for each (a version the shards passed while one was evaluated is
    skipped: the next one read is the newest)."""

    def __init__(
        self,
        addresses: list[str],
        config: RunConfig,
        data: TokenData,
        last_version: int,
        on_eval: Callable[[int, float], None],
        tls: TlsFiles | None = None,
        token: str | None = None,
    ) -> None:
        self.addresses, self.config, self.data, self.last_version = addresses, config, data, last_version
        self.on_eval, self.tls, self.token = on_eval, tls, token
        self.failed = False  # it stopped on an error: the sim's lines fall back to the sites' own evals
        self.watch = LossWatch()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-global-eval", daemon=True)
        self._model: torch.nn.Module | None = None

    def start(self) -> GlobalEvalWatch:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0, drain: bool = False) -> None:
        """Stop the watch; `drain`: first give it up to `timeout` to read the versions still to come."""
        if drain:
            self._thread.join(timeout)
        self._stop.set()
        self._thread.join(timeout)

    def evaluate(self, tensors: dict[str, torch.Tensor]) -> float:
        if self._model is None:
            self._model = build_model(self.config.model, self.data.vocab_size, self.config.seed)
        self._model.load_state_dict(tensors)  # every tensor of the model, or a clear error
        return evaluate_run(self._model, self.config, self.data.eval)

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as error:  # noqa: BLE001 - the sim goes on without it (its lines fall back to the sites')
            if not self._stop.is_set():  # not the shards going away at the end
                self.failed = True
                log.warning("global_eval_unavailable", reason=repr(error))

    def _watch(self) -> None:
        wanted = 1
        while wanted <= self.last_version and not self._stop.is_set():
            try:  # long-polls each shard for `wanted`; shards a version apart are read again at the newer one
                model = from_servers(
                    self.addresses,
                    self.config.run_id,
                    self.tls,
                    self.token,
                    timeout=30,
                    min_version=wanted,
                    wait_seconds=1.0,
                )
            except ExportError as error:  # no site joined yet, none published yet, shards a version apart: again
                if error.not_ready:
                    self._stop.wait(0.2)
                    continue
                raise
            if model.version < wanted:
                continue
            with torch.no_grad():
                loss = self.evaluate(model.tensors)
            verdict = self.watch.observe(model.version, loss)
            if verdict:
                log.warning(
                    f"global_eval_{self.watch.kind}",
                    version=model.version,
                    eval_loss=round(loss, 4) if math.isfinite(loss) else loss,
                    best=round(self.watch.best, 4),
                    reason=verdict,
                )
            self.on_eval(model.version, loss)
            wanted = model.version + 1


def round_line(round_: int, per_rank: dict[tuple[str, int], dict], global_eval: float | None) -> dict:
    """The sim's line for one round, from the `round_done` events of the ranks that reported it (keyed by
    (cluster, rank)); `global_eval`: the shards' model's eval (None: the mean of the clusters' own evals,
    where there was no watch or the shards passed the version before it was read)."""
    events = list(per_rank.values())
    leads = [e for (_, rank), e in per_rank.items() if rank == 0]  # one per cluster

    def mean(key: str) -> float | None:
        return round(sum(e[key] for e in leads) / len(leads), 4) if leads else None

    return {
        "round": round_,
        "eval_loss": mean("eval_loss")
        if global_eval is None
        else (round(global_eval, 4) if math.isfinite(global_eval) else None),
        "eval_of": "sites" if global_eval is None else "global",
        "sites": len(leads),
        "train_loss": mean("train_loss"),
        "tokens": sum(e["tokens"] for e in leads),
        "bytes_up": sum(e["bytes_up"] for e in events),
        "bytes_down": sum(e["bytes_down"] for e in events),
        "seconds": max((e["seconds"] for e in events), default=0.0),
        "comm_s": max((e["comm_s"] for e in events), default=0.0),
        "idle_s": max((e["idle_s"] for e in events), default=0.0),
    }
