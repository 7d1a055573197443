"""When a shard closes a round under a quorum: once `min_clusters` have delivered, how long it waits for
the rest (uneven sites).

Waiting for every site lets the slowest one set the pace of the run; closing at the quorum leaves out a
site that was a moment late. The grace window sits between: it follows how far apart the sites have
been arriving lately (the time from the quorum to the last complete delivery, over the last rounds),
times `factor`, and stays within [`min_s`, `max_s`]. A round where a site missed the window only says
the spread was *at least* the window; it is recorded as such, so the window grows back toward `max_s`
while sites keep missing it by little, and shrinks once they arrive together again.

Plain Python, no clock of its own: the shard passes `time.monotonic()` readings.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class GraceWindow:
    min_s: float
    max_s: float
    factor: float = 1.5
    history: int = 8
    _spreads: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.min_s <= self.max_s:
            raise ValueError(f"the grace window needs 0 ≤ min ≤ max, got min {self.min_s} and max {self.max_s}")
        if not self.factor >= 1:
            raise ValueError(f"the grace factor must be ≥ 1, got {self.factor}")
        self._spreads = deque(maxlen=self.history)

    def seconds(self) -> float:
        """The window for the round now open: `factor` × the widest recent spread, within the bounds.
        With no history yet, the upper bound: a run's first rounds wait rather than drop a site."""
        if not self._spreads:
            return self.max_s
        return min(self.max_s, max(self.min_s, self.factor * max(self._spreads)))

    def observe(self, spread_s: float) -> None:
        """A round closed: its last complete site arrived `spread_s` after the quorum. Where a site missed
        the window the shard passes the window it gave (the spread was at least that), so the next window,
        `factor` times wider, grows toward `max_s` while sites keep missing it."""
        self._spreads.append(max(0.0, spread_s))
