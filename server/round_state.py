"""What a shard collects for the round in progress: token-weighted sums, per slice and per cluster.

Plain Python and torch, no gRPC. Contributions are added to running sums as they arrive (memory stays
one dense tensor per owned slice however many clusters take part), and every (cluster, slice) pair is
recorded, so a retried push is recognised and never double-counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dilocox.common.errors import InvalidFrame
from dilocox.common.framing import SliceKey


@dataclass
class RoundAccumulator:
    """Σ_m w_m·Δ_m and Σ_m w_m per slice for one round."""

    round: int
    sums: dict[SliceKey, torch.Tensor] = field(default_factory=dict)
    weight_sums: dict[SliceKey, float] = field(default_factory=dict)
    delivered: dict[str, set[SliceKey]] = field(default_factory=dict)
    cluster_weights: dict[str, float] = field(default_factory=dict)
    bytes_in: int = 0

    def check_weight(self, cluster: str, weight: float) -> None:
        """A cluster's weight (tokens this round) must be positive and the same on all its streams."""
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise InvalidFrame(f"weight (tokens trained) must be a positive finite number, got {weight}")
        known = self.cluster_weights.get(cluster)
        if known is not None and known != weight:
            raise InvalidFrame(f"cluster {cluster!r} already pushed round {self.round} with weight {known}, now {weight}")

    def is_duplicate(self, cluster: str, key: SliceKey) -> bool:
        return key in self.delivered.get(cluster, ())

    def add(self, cluster: str, weight: float, key: SliceKey, delta: torch.Tensor) -> None:
        """Fold one decoded slice in; callers have vetted shape and duplicates already."""
        self.cluster_weights[cluster] = weight
        scaled = delta.to(torch.float32) * weight
        if key in self.sums:
            self.sums[key].add_(scaled)
            self.weight_sums[key] += weight
        else:
            self.sums[key] = scaled
            self.weight_sums[key] = weight
        self.delivered.setdefault(cluster, set()).add(key)

    def complete_clusters(self, owned: set[SliceKey]) -> set[str]:
        """Clusters that delivered every slice this shard owns."""
        return {c for c, keys in self.delivered.items() if keys >= owned}

    def mean(self, key: SliceKey) -> torch.Tensor | None:
        """The weighted mean pseudo-gradient of a slice, or None if nobody delivered it."""
        if key not in self.sums:
            return None
        return self.sums[key] / self.weight_sums[key]
