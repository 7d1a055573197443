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
"""

from __future__ import annotations

import threading
from typing import Hashable, Iterable, Mapping

import torch


class UndeliveredCarry:
    def __init__(self) -> None:
        self._pending: dict[Hashable, torch.Tensor] = {}
        self._kept: set[tuple[int, Hashable]] = set()  # (push generation, slice) already kept
        self._lock = threading.Lock()  # pushes to several shards run on their own threads
        self.elements = 0  # kept so far, over the run

    def keep(self, generation: int, values: Mapping[Hashable, torch.Tensor]) -> list[Hashable]:
        """Keep push `generation`'s undelivered `values` (what it carried, decoded); returns the keys newly
        kept (a key already kept for this generation is skipped)."""
        with self._lock:
            fresh = [key for key in values if (generation, key) not in self._kept]
            self._kept = {done for done in self._kept if done[0] >= generation - 1} | {(generation, key) for key in fresh}
            for key in fresh:
                value = values[key]
                self._pending[key] = self._pending[key] + value if key in self._pending else value.clone()
                self.elements += value.numel()
            return fresh

    def add_to(self, tensors: Mapping[Hashable, torch.Tensor]) -> Mapping[Hashable, torch.Tensor]:
        """`tensors` with what is pending for their keys added (and no longer pending)."""
        with self._lock:
            carried = {key: self._pending.pop(key) for key in list(self._pending) if key in tensors}
        if not carried:
            return tensors
        return {key: tensors[key] + carried[key] if key in carried else tensors[key] for key in tensors}

    def pending_keys(self) -> Iterable[Hashable]:
        with self._lock:
            return list(self._pending)
