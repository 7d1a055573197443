"""The paper's regime in `dilocox bench wan`: the communication ratio from a stated model and link, and an
AllReduce baseline that stays bounded at r ≥ 300.

r = (one step's gradient AllReduce on the link) / (one step's compute). For a real model on a real link
it is bytes / rate / T: a ring over S sites moves 2·(S−1)/S·b·N bytes through each site's link per step
(N parameters, b bytes per gradient value), at R bit/s, against a step of T seconds. The small CPU
model of the benchmark is then given the link rate at which *its* AllReduce takes r × *its* step.

At r = 300 a step of AllReduce takes 300 steps' compute: the full baseline would run for hours. Its
throughput needs only a few shaped steps (every step is alike: compute, then the same collective), and
its loss curve does not depend on the link at all (same seeds, same data, same arithmetic), so it comes
from a run of the same configuration over an unshaped link. The two are joined on the time axis: each
point of the unshaped curve keeps its measured compute and evaluation time and has its collectives'
time replaced by the shaped steps' (steps so far × shaped collective time per step).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dilocox.bench.allreduce_baseline import ring_bytes_per_rank
from dilocox.bench.projection import MODELS
from dilocox.bench.wan_links import LinkSettings, LoopbackLinks
from dilocox.bench.wan_modes import CurvePoint, Mode, ModeResult

# One inner step's compute time of the paper-size models at a site, as bench/projection assumes (s).
DEFAULT_STEP_S = {"opt-1.3b": 4.0, "dense-107b": 10.0}
SPLIT_FROM_RATIO = 50.0  # at r above this, AllReduce runs split (a few shaped steps + an unshaped curve) by default
DEFAULT_SHAPED_STEPS = 8


@dataclass(frozen=True)
class PaperRegime:
    model: str
    params: int
    sites: int
    link_gbit: float
    step_s: float
    gradient_bytes: int

    @property
    def allreduce_bytes_per_site(self) -> int:
        return ring_bytes_per_rank(self.params, self.sites, self.gradient_bytes)

    @property
    def allreduce_s(self) -> float:
        return self.allreduce_bytes_per_site * 8 / (self.link_gbit * 1e9)

    @property
    def ratio(self) -> float:
        return self.allreduce_s / self.step_s

    def describe(self) -> str:
        return (
            f"{self.model} ({self.params / 1e9:.2f}B parameters) over {self.link_gbit:g} Gbit/s between {self.sites} "
            "sites, "
            f"step {self.step_s:g} s, {self.gradient_bytes}-byte gradients: a ring AllReduce moves "
            f"{self.allreduce_bytes_per_site / 1e9:.1f} GB per site per step, {self.allreduce_s:.1f} s on the link, "
            f"r = {self.ratio:.0f}"
        )


def paper_regime(model: str, sites: int, link_gbit: float, step_s: float | None, gradient_bytes: int) -> PaperRegime:
    if model not in MODELS:
        raise SystemExit(f"dilocox bench wan: unknown --paper-model {model!r}; known: {', '.join(MODELS)}")
    if link_gbit <= 0 or (step_s is not None and step_s <= 0) or gradient_bytes not in (2, 4):
        raise SystemExit("dilocox bench wan: --link-gbit and --step-s must be positive, --gradient-bytes 2 or 4")
    params = sum(math.prod(shape) for _, shape in MODELS[model]())
    return PaperRegime(
        model, params, sites, link_gbit, step_s if step_s is not None else DEFAULT_STEP_S[model], gradient_bytes
    )


def unshaped_links(sites: int) -> LoopbackLinks:
    """Loopback at a rate no collective or stream here comes near, no added latency: the numerics only."""
    return LoopbackLinks(sites, LinkSettings(1e6, 0.0, 0.0), "the unshaped loss run")


def shaped_probe_config(config, steps: int):
    """The same run, cut to `steps` AllReduce steps (one evaluation, at the end)."""
    return dataclasses.replace(config, rounds=1, inner=dataclasses.replace(config.inner, steps=steps))


def join_split(mode: Mode, shaped: ModeResult, unshaped: ModeResult, shaped_steps: int) -> ModeResult:
    """AllReduce's result at the shaped link: its loss curve from the unshaped run, its time axis and
    throughput with the shaped collectives' time per step in place of the unshaped ones'."""
    steps = unshaped.extra["steps"]
    shaped_comm = shaped.comm_s / shaped_steps
    unshaped_comm = unshaped.comm_s / steps
    tokens_per_step = unshaped.tokens / steps
    curve = [
        CurvePoint(
            p.tokens, round(p.seconds + (p.tokens / tokens_per_step) * (shaped_comm - unshaped_comm), 3), p.eval_loss
        )
        for p in unshaped.curve
    ]
    train_s = round(unshaped.train_s + steps * (shaped_comm - unshaped_comm), 3)
    comm_s = round(shaped_comm * steps, 3)
    return dataclasses.replace(
        unshaped,
        label=mode.label,
        curve=curve,
        train_s=train_s,
        comm_s=comm_s,
        idle_fraction=round(comm_s / train_s, 4) if train_s > 0 else float("nan"),
        bytes_sent_per_site=shaped.bytes_sent_per_site / shaped_steps * steps,
        bytes_received_per_site=shaped.bytes_received_per_site / shaped_steps * steps,
        bytes_source=f"{shaped.bytes_source} over {shaped_steps} shaped steps, × {steps / shaped_steps:.1f}",
        wall_s=round(shaped.wall_s + unshaped.wall_s, 1),
        extra={
            **unshaped.extra,
            "split": {
                "shaped_steps": shaped_steps,
                "shaped_comm_s_per_step": round(shaped_comm, 4),
                "shaped_compute_s_per_step": round(shaped.compute_s / shaped_steps, 4),
                "unshaped_comm_s_per_step": round(unshaped_comm, 4),
                "unshaped_train_s": unshaped.train_s,
            },
        },
    )
