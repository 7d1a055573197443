"""The outer loop of one cluster: synchronous DiLoCo rounds against the sharded aggregation service.

Round t (DESIGN.md §3, delay=0): start at θ_{t-1}; run H inner AdamW steps; send
Δ = θ_{t-1} − θ_local, sliced by the shard assignment, to the owning shards in parallel; wait for θ_t;
adopt it. The first cluster to reach an uninitialised shard seeds it with its initial weights
(round 0), so every cluster starts from the same θ_0.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import structlog
import torch

from dilocox.common.assignment import ParamSlice
from dilocox.common.framing import SliceKey
from dilocox.worker.aggregator_client import AggregatorClient
from dilocox.worker.inner_trainer import InnerTrainer

log = structlog.get_logger()


@dataclass
class RoundReport:
    round: int
    train_loss: float
    eval_loss: float
    tokens: int
    bytes_up: int
    bytes_down: int
    compute_s: float
    comm_s: float
    seconds: float


def slice_tensors(slices: list[ParamSlice], full: dict[str, torch.Tensor]) -> dict[SliceKey, torch.Tensor]:
    """Cut full tensors into the assignment's slices (views, no copies)."""
    return {s.key: s.view(full[s.name]) for s in slices if s.name in full}


class DilocoCluster:
    def __init__(self, trainer: InnerTrainer, client: AggregatorClient, rounds: int, run_config_json: str = "") -> None:
        self.trainer = trainer
        self.client = client
        self.rounds = rounds
        self.run_config_json = run_config_json
        self.params = dict(trainer.named_parameters())
        self.slices: list[ParamSlice] = []
        self.version = -1
        self.reports: list[RoundReport] = []
        self.initial_eval_loss: float | None = None

    # ------------------------------------------------------------------ boundaries
    def _current_params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.params.items()}

    def _load(self, pulled: dict[SliceKey, torch.Tensor]) -> None:
        by_key = {s.key: s for s in self.slices}
        missing = set(by_key) - set(pulled)
        if missing:
            raise RuntimeError(f"pull returned no weights for {len(missing)} slices, e.g. {sorted(missing)[0]}")
        with torch.no_grad():
            for key, tensor in pulled.items():
                s = by_key[key]
                s.view(self.params[s.name].data).copy_(tensor)

    def start(self) -> int:
        """Join, seed uninitialised shards, adopt the current global weights; returns the first round to train."""
        info = self.client.join(self.trainer.param_specs(), self.run_config_json)
        self.slices = info.assignment
        if info.needs_init:
            init = slice_tensors([s for s in self.slices if s.shard in info.needs_init], self._current_params())
            sent = self.client.push(0, 1.0, init, shards=info.needs_init)
            log.info("initialised_shards", shards=info.needs_init, bytes_up=sent)
        self.version, pulled, received = self.client.pull(min_version=0)
        self._load(pulled)
        self.initial_eval_loss = self.trainer.evaluate()
        log.info(
            "cluster_started",
            cluster=self.client.cluster,
            version=self.version,
            num_shards=info.num_shards,
            slices=len(self.slices),
            eval_loss=round(self.initial_eval_loss, 4),
            bytes_down=received,
        )
        return self.version + 1

    def run_round(self, round_: int) -> RoundReport:
        started = time.perf_counter()
        theta_start = {name: t.clone() for name, t in self._current_params().items()}
        train_loss, tokens, compute_s = self.trainer.train_steps(self.trainer.config.inner.steps)

        comm_started = time.perf_counter()
        current = self._current_params()
        delta = {name: theta_start[name] - current[name] for name in current}
        bytes_up = self.client.push(round_, float(tokens), slice_tensors(self.slices, delta))
        self.version, pulled, bytes_down = self.client.pull(min_version=round_)
        self._load(pulled)
        comm_s = time.perf_counter() - comm_started

        eval_loss = self.trainer.evaluate()
        report = RoundReport(
            round=round_,
            train_loss=round(train_loss, 4),
            eval_loss=round(eval_loss, 4),
            tokens=tokens,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            compute_s=round(compute_s, 3),
            comm_s=round(comm_s, 3),
            seconds=round(time.perf_counter() - started, 3),
        )
        log.info("round_done", cluster=self.client.cluster, **asdict(report))
        return report

    def run(self) -> list[RoundReport]:
        first = self.start()
        for round_ in range(first, self.rounds + 1):
            self.reports.append(self.run_round(round_))
        log.info(
            "cluster_done",
            cluster=self.client.cluster,
            rounds=len(self.reports),
            initial_eval_loss=round(self.initial_eval_loss or float("nan"), 4),
            final_eval_loss=self.reports[-1].eval_loss if self.reports else None,
            bytes_up=self.client.traffic.bytes_up,
            bytes_down=self.client.traffic.bytes_down,
        )
        return self.reports
