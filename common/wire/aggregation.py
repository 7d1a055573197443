"""The token-weighted mean of a round's pseudo-gradients, computed identically everywhere.

Shards and clusters both run this function on the same decoded contributions: the shard to step its
global weights, each cluster to replay that step on its own copy (the compressed downlink forwards
contributions, not weights). Summing in cluster-name order with the same float operations makes the
results bit-identical, whatever order the pushes arrived in.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

Contribution = tuple[str, float, Callable[[], torch.Tensor]]  # (cluster, weight, decode)


def weighted_mean(contributions: Iterable[Contribution]) -> torch.Tensor | None:
    """Σ w·Δ / Σ w over the contributions, in cluster order; decodes one contribution at a time."""
    total = 0.0
    acc: torch.Tensor | None = None
    scaled: torch.Tensor | None = None  # one temporary, reused: a fresh tensor per contribution costs page faults
    for _, weight, decode in sorted(contributions, key=lambda c: c[0]):
        delta = decode().to(torch.float32)
        # A multiply, then an add: `add_(delta, alpha=w)` may fuse into one FMA on some CPUs and not on
        # others, and shards and clusters must round alike (see lowrank.ordered_product).
        if acc is None:
            acc = delta * weight
        else:
            scaled = delta * weight if scaled is None or scaled.shape != delta.shape else torch.mul(delta, weight, out=scaled)
            acc.add_(scaled)
        total += weight
    if acc is None:
        return None
    return acc.div_(total)
