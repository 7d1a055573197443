"""`--aggregate clipped-mean`: no one site moves a round's step by more than a bounded share, flagged or not.

Why: the update check (server/checks/update_check.py) catches what stands out — ×100, a sign flip, a replay —
but a site that stays under its bounds is merged whole. An update ×9.5 every round (just under the check's
10×) was never flagged and raised the final eval 70.8 %. Robust aggregation bounds any minority's
influence whether or not it is caught: here, norm clipping to the round's peers — each site's update scaled
down to at most `clip_multiple` × the median of the *other* sites' norms (leave-one-out, so a site cannot
raise its own bound; with two sites, the other's norm). Honest sites' norms sit within 1.5× of the median
(docs/decisions.md, the check's calibration), so the default 2× leaves them whole.

Why clipping and not a trimmed mean or a coordinate-wise median: the factor is one number per site and slice
set, forwarded with its contributions (proto `scale`, as the check's clip), so every site's replay of the
round stays bit-exact and the compressed downlink is unchanged; a coordinate-wise rule would need the
decoded dense updates on every replica. Each shard clips on the norms of its own slices, as the check judges.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from dilocox.common.wire.peer_median import medians_of_others

AGGREGATES = ("mean", "clipped-mean")


@dataclass(frozen=True)
class AggregateConfig:
    rule: str = "mean"
    clip_multiple: float = 2.0  # clipped-mean: a site's update at most this × the median of the others' norms

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATES:
            raise ValueError(f"--aggregate must be one of {', '.join(AGGREGATES)}, got {self.rule!r}")
        if not self.clip_multiple >= 1:
            raise ValueError(f"--aggregate-clip-multiple must be ≥ 1, got {self.clip_multiple}")


def clip_factors(norms: Mapping[str, float], multiple: float) -> dict[str, float]:
    """The factor (< 1) for each site whose update's norm exceeds `multiple` × the median of the other
    sites' finite norms; sites within it, and a lone site, are not listed. A non-finite norm is scaled to 0
    where others exist (nothing of it can be merged)."""
    finite = {c: x for c, x in norms.items() if math.isfinite(x)}
    others = medians_of_others(finite)  # a non-finite site's others: every finite one
    everyone = statistics.median(finite.values()) if finite else None
    out = {}
    for cluster, norm in norms.items():
        reference = others[cluster] if cluster in finite else everyone
        if reference is None or math.isnan(norm):
            continue
        bound = multiple * reference
        if norm > bound:
            out[cluster] = bound / norm if math.isfinite(norm) else 0.0
    return out
