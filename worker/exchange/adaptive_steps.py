"""Adaptive H: choose the inner steps per round so that one round's communication hides behind its compute.

With the one-step delay, round t's exchange travels while round t+1 computes; it stays hidden as long
as comm_s ≤ compute_s. After each boundary the controller compares the exchange it just collected with
the round's compute: if the link needs longer, H grows in proportion (up to `max_steps`); if the link
is idle most of the round, H shrinks back toward the configured base. Every change is logged with its
reason. A pinned H (`--inner-adaptive-steps false`) never changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

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
            log.info(
                "inner_steps_adapted",
                round=round_,
                steps=new,
                previous=self.steps,
                reason=f"exchange took {comm_s:.3f}s, a step {per_step:.4f}s: {needed} steps cover it at "
                f"{self.target:.0%}",
            )
            self.steps = new
        return self.steps


class RoundTimeBox:
    """Time-boxed rounds (issues 36, 47): every site trains `seconds` of wall time per round, whatever its
    speed, so uneven sites deliver together and none waits for another. A site's pseudo-gradient carries
    its true token count, and the shards average by tokens, so a slower site weighs what it trained.

    The round ends when its time is up, checked as the steps run — not at an H estimated beforehand: a
    site whose steps slow down after the estimate (preempted, throttled, stopped, restarted) used to train
    its estimated H whatever it cost (84 steps in 63 s for a 6 s box), then merge that stale work at full
    weight. A site's ranks must end on the same step (their collectives pair up), so they agree at
    check points: each proposes how many steps to train before the next check (`next_stride`, 0 once its
    deadline has passed) and the site takes the smallest (`agree_min`, one small collective per check,
    not per step). One process checks after every step: its round ends within one step of its box; a
    site of several ranks checks about `CHECKS_PER_BOX` times a box, so it ends within 1/16 of the box
    (plus one step) after it. At least `min_steps` are trained whatever the clock says (logged when that
    overruns the box), and never more than `max_steps`.

    `steps` is the estimate: the budget over the last round's measured seconds per step, the H a round at
    this speed makes (reported, and the progress display's denominator).

    A site whose last exchange came back *late* (the shards closed that round without it, under quorum +
    grace) is out of phase with the others — after a stall it stays a round behind for good, every part of
    its work carried a round late. Its next box is shortened by `CATCH_UP` of the budget, and again while
    it is late: each shortened round moves its phase forward, and once it is on time again full boxes
    keep it there."""

    CHECKS_PER_BOX = 16
    CATCH_UP = 0.25

    def __init__(
        self, base_steps: int, seconds: float, min_steps: int = 1, max_steps: int = 10_000, single_process: bool = True
    ) -> None:
        if not seconds > 0:
            raise ValueError(f"the round's time budget must be positive, got {seconds}")
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"need 1 ≤ min steps ≤ max steps, got {min_steps} and {max_steps}")
        self.seconds = seconds
        self.min = min_steps
        self.max = max_steps
        self.single_process = single_process
        self.steps = min(max(base_steps, min_steps), max_steps)
        self.round, self.began, self.deadline = 0, 0.0, 0.0
        self.check_at, self.time_up = 1, False  # the round's next check of the clock, and its verdict
        self.late = False  # the last exchange came back late: the next box catches up

    def begin_round(self, round_: int, now: float) -> None:
        """Round `round_`'s training starts at `now` (time.monotonic(): it runs on while a process is stopped)."""
        budget = self.seconds * (1 - self.CATCH_UP) if self.late else self.seconds
        if self.late:
            log.info(
                "time_box_catching_up",
                round=round_,
                budget_s=round(budget, 3),
                reason="the last exchange came back late: this round is shorter, to deliver with the others",
            )
        self.round, self.began, self.deadline = round_, now, now + budget
        self.check_at, self.time_up = 1, False

    def steps_to_check(self, steps_done: int) -> int:
        """Steps to train before the round may end: to its next check, or to `min_steps` once time is up."""
        return max(1, min(self.check_at, self.max) - steps_done)

    def ends_after(self, steps_done: int, agree_min: Callable[[int], int]) -> bool:
        """Whether the round ends after `steps_done` steps. At a check the site's ranks agree (`agree_min`
        over them, the same call on every rank since they train the same steps) whether any one's time is
        up and when to check next; once time is up the round ends as soon as it has `min_steps`."""
        if steps_done < min(self.check_at, self.max):
            return False
        if not self.time_up and steps_done < self.max:
            stride = agree_min(self.next_stride(steps_done, time.monotonic()))
            self.time_up = stride == 0
            self.check_at = steps_done + stride
        if steps_done >= self.max or (self.time_up and steps_done >= self.min):
            return True
        if self.check_at < self.min:  # the box ran out before the fewest steps a round may have
            log.warning(
                "time_box_overrun",
                round=self.round,
                steps=steps_done,
                min_steps=self.min,
                budget_s=self.seconds,
                reason="the box ran out before --inner-min-steps: the round trains on to them",
            )
            self.check_at = self.min
        return False

    def next_stride(self, steps_done: int, now: float) -> int:
        """This rank's proposal after `steps_done` steps: 0 when its box is over, else the steps to train
        before the next check (1 for one process, whose checks cost nothing)."""
        if now >= self.deadline:
            return 0
        if self.single_process or steps_done == 0:
            return 1
        per_step = (now - self.began) / steps_done
        window = min(self.seconds / self.CHECKS_PER_BOX, self.deadline - now)
        return max(1, int(window / per_step)) if per_step > 0 else 1

    def _fit(self, per_step: float) -> int:
        return min(self.max, max(self.min, round(self.seconds / per_step))) if per_step > 0 else self.steps

    def update(self, round_: int, compute_s: float, comm_s: float = 0.0) -> int:
        """The estimate for the next round, from this round's compute seconds (at `self.steps` steps)."""
        if compute_s <= 0:
            return self.steps
        per_step = compute_s / self.steps
        new = self._fit(per_step)
        if new != self.steps:
            log.info(
                "inner_steps_time_boxed",
                round=round_,
                steps=new,
                previous=self.steps,
                step_s=round(per_step, 4),
                budget_s=self.seconds,
            )
            self.steps = new
        return self.steps


def steps_controller_for(inner, single_process: bool) -> StepsController | RoundTimeBox | None:  # noqa: ANN001 - InnerConfig
    """How a site sets H each round: time-boxed where the run asks for it (`inner.round_time_s`), else
    adaptive H where asked and the site is one process (a pipeline's ranks keep H fixed), else fixed."""
    if inner.round_time_s > 0:
        # whether it checks the clock after every step or at agreed points: set by the cluster from its access
        return RoundTimeBox(inner.steps, inner.round_time_s, inner.min_steps, max(inner.steps, inner.max_steps))
    if single_process:
        return StepsController(inner.steps, max(inner.steps, inner.max_steps), enabled=inner.adaptive_steps)
    return None
