"""The training modes the WAN benchmark compares, and what one run of a mode yields.

A mode is a runner ("allreduce": bench/allreduce_baseline.py; "diloco": shards + clusters through the
relay) plus overrides of the run configuration shared by all modes (model, data, rounds × H, batch).
A new mode is one more entry in `MODES` (run by default) or `ABLATIONS` (the paper's ablations of
DiLoCoX, run when named); `dilocox bench wan --modes` picks any subset, and every mode trains the same
number of tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dilocox.common.config.run import RunConfig, from_dict


@dataclass(frozen=True)
class Mode:
    name: str
    label: str
    runner: str  # "allreduce" | "diloco"
    overrides: dict = field(default_factory=dict)  # nested, as a config file's tables

    def config(self, base: RunConfig) -> RunConfig:
        return from_dict(self.overrides, base)


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("allreduce", "data-parallel AllReduce every step (gloo)", "allreduce"),
        Mode("diloco", "DiLoCo (synchronous, no compression)", "diloco", {"delay": 0, "compress": {"codec": "fp32"}}),
        Mode("dilocox", "DiLoCoX (one-step delay + adaptive low-rank int4)", "diloco", {"delay": 1}),
    )
}
# The paper's ablations: DiLoCoX (as configured) with one part taken out. Not run unless named.
ABLATIONS: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("no-delay", "DiLoCoX without the one-step delay (synchronous, compressed)", "diloco", {"delay": 0}),
        Mode(
            "no-compression",
            "DiLoCoX without compression (fp32 uplink, delayed)",
            "diloco",
            {"compress": {"codec": "fp32"}},
        ),
        Mode("no-ef", "DiLoCoX without error feedback", "diloco", {"compress": {"error_feedback": False}}),
        Mode(
            "fixed",
            "DiLoCoX with fixed rank (r_max) and fixed H",
            "diloco",
            {"compress": {"adaptive_rank": False}, "inner": {"adaptive_steps": False}},
        ),
        Mode(
            "adaptive-h",
            "DiLoCoX with adaptive H (grows H while the exchange outlasts compute)",
            "diloco",
            {"inner": {"adaptive_steps": True}},
        ),
    )
}
ALL_MODES: dict[str, Mode] = {**MODES, **ABLATIONS}


@dataclass
class CurvePoint:
    tokens: int  # summed over sites
    seconds: float  # since the mode's training started
    eval_loss: float


@dataclass
class ModeResult:
    mode: str
    label: str
    tokens: int
    train_s: float  # first site ready to train → last site done (final evaluation included)
    initial_eval_loss: float
    final_eval_loss: float
    curve: list[CurvePoint]
    idle_fraction: float  # share of the sites' wall time spent blocked on the network
    compute_s: float  # per site, mean
    comm_s: float  # per site, mean: time in the exchange (AllReduce: in the collectives)
    bytes_sent_per_site: float
    bytes_received_per_site: float
    bytes_source: str  # "interface counters" | "relay" | "computed (ring all-reduce)"
    app_bytes_sent_per_site: float  # at the application layer (gRPC message sizes / gradient bytes)
    wall_s: float = 0.0  # processes started → stopped
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_s if self.train_s > 0 else float("nan")

    def time_to(self, target: float) -> float | None:
        """Seconds until the first evaluation at or below `target` (None: never reached)."""
        for point in self.curve:
            if point.eval_loss <= target:
                return point.seconds
        return None

    def finite(self) -> bool:
        return math.isfinite(self.final_eval_loss)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
