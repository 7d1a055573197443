"""A site made slower on purpose, for benchmarks of uneven sites (`dilocox worker --simulate-slowdown F`).

Every call of `train_steps` sleeps (F − 1) times what its steps took, so the site trains at 1/F of its
speed with the same arithmetic: its tokens, losses and weights are what they would be, only later. A
sleep, not fewer threads, so that the slowdown is exactly F on a machine whose cores the benchmark's
other processes share (`dilocox bench uneven`, docs/performance.md).
"""

from __future__ import annotations

import time


class SlowedTrainer:
    def __init__(self, trainer: object, factor: float) -> None:
        if not factor >= 1:
            raise ValueError(f"a slowdown factor must be ≥ 1, got {factor}")
        self._trainer = trainer
        self.factor = factor

    def train_steps(self, n: int) -> tuple[float, int, float]:
        started = time.perf_counter()
        loss, tokens, _ = self._trainer.train_steps(n)
        time.sleep((self.factor - 1) * (time.perf_counter() - started))
        return loss, tokens, time.perf_counter() - started

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the wrapped trainer's
        return getattr(self._trainer, name)
