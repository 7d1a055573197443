"""What a shard collects for the round in progress: each cluster's encoded contribution per slice.

Plain Python and torch, no gRPC. Contributions are kept *encoded* (compressed payloads are small) and
decoded only when the round closes, in cluster order: the same arithmetic every cluster
replays from the forwarded payloads (see `common.aggregation`). Every (cluster, slice) pair is recorded,
so a retried push is recognised and never double-counted.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from dilocox.common.wire.aggregation import apply_round, decode_by_blocks
from dilocox.common.wire.errors import InvalidFrame
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.common.wire.staleness import cap_claimed_weights, cap_stale_weights, stale_discount


@dataclass(frozen=True)
class Contribution:
    cluster: str
    weight: float
    slice: EncodedSlice
    scale: float = 1.0  # the update check's clip factor: merged as scale·Δ at its full weight (forwarded with it)


@dataclass
class RoundAccumulator:
    """Contributions of one round, per slice and per cluster."""

    round: int
    contributions: dict[SliceKey, dict[str, Contribution]] = field(default_factory=dict)
    cluster_weights: dict[str, float] = field(default_factory=dict)  # tokens, as each cluster said
    cluster_ages: dict[str, int] = field(default_factory=dict)  # rounds its work is older than this round (0: on time)
    # The newest version each cluster had pulled from this shard when its first part of the round came: its
    # work was trained from that version or an older one, whatever age it declares.
    trained_from: dict[str, int] = field(default_factory=dict)
    declared_ages: dict[str, int] = field(
        default_factory=dict
    )  # an age `weigh` found understated, as the cluster said it
    bytes_in: int = 0
    first_push_at: float | None = None  # monotonic time of the round's first contribution: starts the deadline
    quorum_at: float | None = None  # monotonic time `min_clusters` had completed: starts the grace window
    complete_at: dict[str, float] = field(default_factory=dict)  # cluster -> when it completed (as first seen)
    delivered: dict[str, int] = field(
        default_factory=dict
    )  # cluster -> slices it delivered (kept by `add`, `keep_only`)

    def check_weight(self, cluster: str, weight: float, staleness: int = 0) -> None:
        """A cluster's weight (tokens this round) must be positive and the same on all its streams, and so
        must its staleness (≥ 0)."""
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise InvalidFrame(f"weight (tokens trained) must be a positive finite number, got {weight}")
        if staleness < 0:
            raise InvalidFrame(f"staleness (rounds the work is older than the round) must be ≥ 0, got {staleness}")
        known = self.cluster_weights.get(cluster)
        if known is not None and known != weight:
            raise InvalidFrame(
                f"cluster {cluster!r} already pushed round {self.round} with weight {known}, now {weight}"
            )
        age = self.cluster_ages.get(cluster)
        if age is not None and age != staleness:
            raise InvalidFrame(
                f"cluster {cluster!r} already pushed round {self.round} with staleness {age}, now {staleness}"
            )

    def is_duplicate(self, cluster: str, key: SliceKey) -> bool:
        return cluster in self.contributions.get(key, {})

    def add(
        self, cluster: str, weight: float, encoded: EncodedSlice, staleness: int = 0, held: int | None = None
    ) -> None:
        """Record one vetted slice; callers have checked shape, values and duplicates already. `held`: the
        newest version the cluster has pulled from this shard (None: not known, e.g. since a shard restart)."""
        self.cluster_weights[cluster] = weight
        self.cluster_ages[cluster] = staleness
        if held is not None:
            self.trained_from.setdefault(cluster, held)
        per_key = self.contributions.setdefault(encoded.key, {})
        if cluster not in per_key:
            self.delivered[cluster] = self.delivered.get(cluster, 0) + 1
        per_key[cluster] = Contribution(cluster, weight, encoded)
        if self.first_push_at is None:
            self.first_push_at = time.monotonic()

    def complete_clusters(self, owned: set[SliceKey]) -> set[str]:
        """Clusters that delivered every slice this shard owns (only owned slices are ever added: vetted).
        From the counts `add` keeps, not a walk over the slices: it runs at every push, under the shard's
        lock, and slices × sites per push grew as sites² × slices a round."""
        return {c for c, n in self.delivered.items() if n == len(owned)}

    def partial_clusters(self, complete: set[str]) -> set[str]:
        """Clusters with part of their slices in (a delivery under way), given the `complete` ones."""
        return set(self.delivered) - complete

    def keep_only(self, clusters: set[str]) -> int:
        """Drop the partial contributions of clusters that did not complete the round; returns the payload
        bytes dropped (those clusters keep what this shard refuses and deliver it next round)."""
        dropped = 0
        for per_key in self.contributions.values():
            for cluster in [c for c in per_key if c not in clusters]:
                dropped += len(per_key.pop(cluster).slice.payload)
        self.cluster_weights = {c: w for c, w in self.cluster_weights.items() if c in clusters}
        self.cluster_ages = {c: a for c, a in self.cluster_ages.items() if c in clusters}
        self.trained_from = {c: v for c, v in self.trained_from.items() if c in clusters}
        self.delivered = {c: n for c, n in self.delivered.items() if c in clusters}
        return dropped

    def understated_ages(self) -> dict[str, tuple[int, int]]:
        """Clusters whose declared age is younger than their work can be: work pushed to round r by a cluster
        that had pulled at most version v was trained from v or older, so it is at least r − 1 − v rounds
        old (an on-time site holds r − 1 when it pushes r, with the delay or without). (declared, least)."""
        least = {c: self.round - 1 - held for c, held in self.trained_from.items()}
        return {c: (self.cluster_ages.get(c, 0), age) for c, age in least.items() if age > self.cluster_ages.get(c, 0)}

    def weigh(
        self, claim_multiple: float = 0.0, stale_rule: str = "inverse", check_ages: bool = True
    ) -> dict[str, tuple[int, float, float, float]]:
        """Before the step (on the sealed round): each contribution's weight — its said tokens, re-discounted
        by its age where the declared one is younger than the version it was trained from allows
        (`understated_ages`, by the run's `stale_rule`: an age is a claim too), capped at `claim_multiple` ×
        the median of the other sites' (tokens are a claim), then, if stale, at the mean of the on-time ones
        (common/wire/staleness.py). The capped weight is the contribution's from here on — the shard's mean
        and what it forwards, so the clusters replay the same arithmetic. Returns the clusters whose weight
        changed: (age used, tokens said — re-discounted where the age was understated —, after the claim cap,
        weight used). `check_ages` False: the end-of-run
        flush (residuals, pushed before a late site catches its replica up), taken at its declared age."""
        said = dict(self.cluster_weights)
        for cluster, (declared, least) in (self.understated_ages() if check_ages else {}).items():
            said[cluster] *= stale_discount(least, stale_rule) / stale_discount(declared, stale_rule)
            self.declared_ages[cluster], self.cluster_ages[cluster] = (
                declared,
                least,
            )  # the record and the stale cap use `least`
        claimed = cap_claimed_weights(said, claim_multiple)
        capped = cap_stale_weights(claimed, self.cluster_ages)
        changed = {
            c: (self.cluster_ages.get(c, 0), said[c], claimed[c], capped[c])
            for c in self.cluster_weights
            if capped[c] != self.cluster_weights[c]
        }
        if changed:
            for per_key in self.contributions.values():
                for cluster in [c for c in per_key if c in changed]:
                    per_key[cluster] = replace(per_key[cluster], weight=capped[cluster])
        return changed

    def reweigh(self, weights: Mapping[str, float]) -> None:
        """Before the step: these clusters' contributions carry these weights from here on (forwarded, so the
        clusters replay the same arithmetic) — the update check's count of copies as one."""
        for per_key in self.contributions.values():
            for cluster in [c for c in per_key if c in weights]:
                per_key[cluster] = replace(per_key[cluster], weight=weights[cluster])

    def used_weights(self) -> dict[str, float]:
        """The weight each cluster's contributions carry into the mean (after `weigh`), by cluster."""
        return {c: x.weight for per_key in self.contributions.values() for c, x in per_key.items()}

    def clip(self, factors: dict[str, float]) -> None:
        """Before the step (on the sealed round): the update check's clip factors, on every slice of each
        clipped cluster. Like a capped weight, the factor is the contribution's from here on — in the
        shard's mean and in what it forwards, so the clusters replay the same arithmetic."""
        for per_key in self.contributions.values():
            for cluster in [c for c in per_key if c in factors]:
                per_key[cluster] = replace(per_key[cluster], scale=factors[cluster])

    def apply(
        self, key: SliceKey, optimizer: OuterNesterov, param: torch.Tensor, in_place: bool
    ) -> torch.Tensor | None:
        """The slice's outer step on the weighted mean of its contributions, or None if nobody
        delivered it. fp32 payloads decode to views of their bytes and low-rank ones to their factors: they
        are taken together and the mean is fused into the step (see `aggregation.apply_round`)."""
        per_cluster = self.contributions.get(key, {}).values()
        together = decode_by_blocks(c.slice.codec for c in per_cluster)
        items = [(c.cluster, c.weight, c.slice.decode_lazy) for c in per_cluster]
        scales = {c.cluster: c.scale for c in per_cluster if c.scale != 1.0}
        return apply_round(items, optimizer, key, param, in_place=in_place, decode_together=together, scales=scales)
