"""Adaptive H: choose the inner steps per round so that one round's communication hides behind its compute.

With the one-step delay, round t's exchange travels while round t+1 computes; it stays hidden as long
as comm_s ≤ compute_s. After each boundary the controller compares the exchange it just collected with
the round's compute: if the link needs longer, H grows in proportion (up to `max_steps`); if the link
is idle most of the round, H shrinks back toward the configured base. Every change is logged with its
reason. A pinned H (`--inner-adaptive-steps false`) never changes.
"""

from __future__ import annotations

import math

import structlog

log = structlog.get_logger()


class StepsController:
    def __init__(self, base_steps: int, max_steps: int, target: float = 0.9, enabled: bool = True) -> None:
        if not 1 <= base_steps <= max_steps:
            raise ValueError(f"need 1 ≤ steps ≤ max steps, got {base_steps} and {max_steps}")
        if not 0 < target <= 1:
            raise ValueError(f"target must be in (0, 1], got {target}")
        self.base = base_steps
        self.max = max_steps
        self.target = target
        self.enabled = enabled
        self.steps = base_steps

    def update(self, round_: int, compute_s: float, comm_s: float) -> int:
        """The H for the next round, from this round's compute time and the exchange's duration."""
        if not self.enabled or compute_s <= 0 or comm_s <= 0:
            return self.steps
        per_step = compute_s / self.steps
        needed = math.ceil(comm_s / (self.target * per_step))  # steps whose compute covers the exchange
        if needed > self.steps:
            new = min(self.max, needed)
        elif needed < self.steps // 2:
            new = max(self.base, needed)
        else:
            new = self.steps
        if new != self.steps:
            log.info("inner_steps_adapted", round=round_, steps=new, previous=self.steps,
                     reason=f"exchange took {comm_s:.3f}s, a step {per_step:.4f}s: {needed} steps cover it at {self.target:.0%}")  # fmt: skip
            self.steps = new
        return self.steps


class RoundTimeBox:
    """Time-boxed rounds (issue 36): every site trains about `seconds` of wall time per round, whatever
    its speed, so uneven sites deliver together and none waits for another. H for the next round is the
    budget over this round's measured seconds per step, within [`min_steps`, `max_steps`]; the first
    round trains the configured H (nothing is measured yet). A site's pseudo-gradient carries its true
    token count, and the shards average by tokens, so a slower site weighs what it trained. In the first
    round nothing is measured yet: the site trains `probe_steps` steps, sets that round's H from them
    (`from_probe`), and goes on; without the probe a slow site's first round would train the configured
    H and every other site would wait for it once.

    The same `update` as `StepsController`; a site's ranks agree on the smallest H (the cluster does it),
    since its slowest rank sets its round's time."""

    def __init__(self, base_steps: int, seconds: float, min_steps: int = 1, max_steps: int = 10_000) -> None:
        if not seconds > 0:
            raise ValueError(f"the round's time budget must be positive, got {seconds}")
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"need 1 ≤ min steps ≤ max steps, got {min_steps} and {max_steps}")
        self.seconds = seconds
        self.min = min_steps
        self.max = max_steps
        self.steps = min(max(base_steps, min_steps), max_steps)
        self.probe_steps = min(3, self.steps)
        self.needs_probe = True

    def _fit(self, per_step: float) -> int:
        return min(self.max, max(self.min, round(self.seconds / per_step))) if per_step > 0 else self.steps

    def from_probe(self, steps: int, seconds: float) -> int:
        """The first round's H, from its first `steps` steps having taken `seconds`."""
        self.needs_probe = False
        new = self._fit(seconds / steps)
        if new != self.steps:
            log.info("inner_steps_time_boxed", round=1, steps=new, previous=self.steps, step_s=round(seconds / steps, 4),
                     budget_s=self.seconds, probe_steps=steps)  # fmt: skip
            self.steps = new
        return self.steps

    def update(self, round_: int, compute_s: float, comm_s: float = 0.0) -> int:
        """The H for the next round, from this round's compute seconds (at `self.steps` steps)."""
        self.needs_probe = False
        if compute_s <= 0:
            return self.steps
        per_step = compute_s / self.steps
        new = self._fit(per_step)
        if new != self.steps:
            log.info("inner_steps_time_boxed", round=round_, steps=new, previous=self.steps, step_s=round(per_step, 4),
                     budget_s=self.seconds)  # fmt: skip
            self.steps = new
        return self.steps


def steps_controller_for(inner, single_process: bool) -> StepsController | RoundTimeBox | None:  # noqa: ANN001 - InnerConfig
    """How a site sets H each round: time-boxed where the run asks for it (`inner.round_time_s`), else
    adaptive H where asked and the site is one process (a pipeline's ranks keep H fixed), else fixed."""
    if inner.round_time_s > 0:
        return RoundTimeBox(inner.steps, inner.round_time_s, inner.min_steps, max(inner.steps, inner.max_steps))
    if single_process:
        return StepsController(inner.steps, max(inner.steps, inner.max_steps), enabled=inner.adaptive_steps)
    return None
