"""What a shard closed its round without: kept by the cluster and delivered with the next push.

Each shard closes a round on its own clock. Under a deadline, a late cluster can be in round t on one
shard and out of it on another; a shard restarted from its checkpoint has lost the open round's pushes.
Rather than coordinate one member set across shards (a shard-to-shard exchange on every round, see
docs/decisions.md), the cluster keeps the refused part of its pseudo-gradient and adds it to the same
slices' next push — the same idea as error feedback, one round late and exact. Nothing it computed is
lost, and nothing is delivered twice: a shard answers a retry of a push it did include as a duplicate,
and each push's slice is kept at most once however often its bytes are refused (a push is one
*generation*: a retry or re-push of the same bytes is the same generation; a new encoding, which may
already hold earlier kept values, is a new one).

**Tokens and age.** A shard averages a round by tokens: Σ w_i Δ_i / Σ w_i. A kept part remembers the
weight w_g it was pushed with and the round g it was trained for, and is added to the next push (round r,
weight w) scaled by d(r − g) · min(w_g, w) / w: the shard's numerator gets d · min(w_g, w) · Δ_g, while the
denominator counts the round's own tokens only. d is the staleness discount of common/wire/staleness.py
(1/(1 + age) by default; 1 with `full`, which gives the numerator exactly w_g Δ_g, what it would have had
on time); the min keeps a late part from weighing more than the push it rides with. Summing the tokens
into the next push's weight instead would give the late part a larger share of the mean than it ever had
(2/3 instead of 1/2 for two equal sites), and the bench of uneven sites showed the loss jump when it did
(docs/decisions.md, "Uneven sites"). With `full` and equal weights (fixed H) nothing is scaled: the kept
values are added as they are, bit for bit as before.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping

import torch

from dilocox.common.wire.staleness import check_rule, stale_discount


class UndeliveredCarry:
    def __init__(self, stale_weighting: str = "inverse") -> None:
        self.stale_weighting = check_rule(stale_weighting)
        # key -> (weight pushed with, round trained for, values)
        self._pending: dict[Hashable, list[tuple[float, int, torch.Tensor]]] = {}
        self._kept: set[tuple[int, Hashable]] = set()  # (push generation, slice) already kept
        self._lock = threading.Lock()  # pushes to several shards run on their own threads
        self.elements = 0  # kept so far, over the run

    def keep(
        self, generation: int, values: Mapping[Hashable, torch.Tensor], weight: float = 1.0, trained: int = 0
    ) -> list[Hashable]:
        """Keep push `generation`'s undelivered `values` (what it carried, decoded, pushed with `weight`,
        trained for round `trained`); returns the keys newly kept (a key already kept for this generation
        is skipped)."""
        with self._lock:
            fresh = [key for key in values if (generation, key) not in self._kept]
            self._kept = {done for done in self._kept if done[0] >= generation - 1} | {
                (generation, key) for key in fresh
            }
            for key in fresh:
                self._pending.setdefault(key, []).append((float(weight), int(trained), values[key].clone()))
                self.elements += values[key].numel()
            return fresh

    def add_to(
        self, tensors: Mapping[Hashable, torch.Tensor], weight: float = 1.0, round_: int = 0, in_place: bool = False
    ) -> Mapping[Hashable, torch.Tensor]:
        """`tensors` (to be pushed to round `round_` with `weight`) with what is pending for their keys
        added, each part scaled by its age's discount and its own weight (at most `weight`) over `weight`
        (and no longer pending); `in_place`: added into `tensors` themselves (the outgoing buffer)."""
        with self._lock:
            carried = {key: self._pending.pop(key) for key in list(self._pending) if key in tensors}
        if not carried:
            return tensors
        out = dict(tensors)
        for key, parts in carried.items():
            for kept_weight, trained, values in parts:
                scale = self.scale(kept_weight, trained, weight, round_)
                part = values if scale == 1.0 else values * scale
                out[key] = out[key].add_(part.reshape(out[key].shape)) if in_place else out[key] + part
        return out

    def scale(self, kept_weight: float, trained: int, weight: float, round_: int) -> float:
        """The factor on a part kept from round `trained` (pushed with `kept_weight`) riding with a push to
        round `round_` with `weight`: w_g / w as it was on time, discounted by its age and capped at 1."""
        if self.stale_weighting == "full":
            return kept_weight / weight
        return stale_discount(max(0, round_ - trained), self.stale_weighting) * min(kept_weight, weight) / weight

    def pending_keys(self) -> Iterable[Hashable]:
        with self._lock:
            return list(self._pending)
