"""What blows a model up, seen in its loss curve: a non-finite value, or a jump past a bound (issue 47).

A late site's stale work merged at 95 % weight once took both sites' eval loss from 6.8 to 29 with no
alert and two warnings that did not say so. Each site watches the eval of the model it starts every round
from (the global weights less its own residual and round in flight: where the global model goes, it
goes), logs `loss_spike` / `loss_nonfinite` and exports the ratio to its best eval so far, which the
shipped alert rules read per site and over all sites (every site spiking at once is the global model);
the sim watches the global model itself (sim/global_eval.py).
"""

from __future__ import annotations

import math

# A round's eval more than this many times the best so far is a spike. Ordinary training noise between
# rounds is a few percent; a merged update that blows a model up multiplies the loss.
SPIKE_RATIO = 1.5


class LossWatch:
    def __init__(self, ratio: float = SPIKE_RATIO) -> None:
        if not ratio > 1:
            raise ValueError(f"a spike ratio must be > 1, got {ratio}")
        self.ratio = ratio
        self.best = math.inf
        self.last_ratio = math.nan  # the last observed loss over the best before it (nan: nothing to compare)
        self.nonfinite = 0  # non-finite losses seen

    def observe(self, round_: int, loss: float) -> str | None:
        """Take round `round_`'s loss; returns why it is alarming, or None."""
        if not math.isfinite(loss):
            self.nonfinite += 1
            self.last_ratio = math.inf
            return f"round {round_}'s loss is {loss}"
        verdict = None
        if math.isfinite(self.best):
            self.last_ratio = loss / self.best if self.best > 0 else math.nan
            if loss > self.ratio * self.best:
                verdict = f"round {round_}'s loss {loss:.4f} is over {self.ratio:g}× the best so far ({self.best:.4f})"
        self.best = min(self.best, loss)
        return verdict
