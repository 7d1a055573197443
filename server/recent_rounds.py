"""The contributions of a shard's newest versions, kept so a site that comes back behind replays them.

A site restarted from its checkpoint holds the replica of the global model at the version it saved
(worker/exchange/replica_state.py). Instead of the weights and momentum in full — 8 bytes per parameter
over the WAN, 856 GB at 107B — it needs only the rounds since, compressed as the clusters pushed them. The
newest version's contributions are in its `Snapshot` already (the steady-state downlink forwards them);
this keeps those of the `keep_rounds - 1` versions before it, without gaps, so a site up to
`keep_rounds` versions behind replays. They cost their compressed bytes (`bytes_kept`, a metric): per
version, the sum over clusters of their pushes to this shard.
"""

from __future__ import annotations

import threading
from collections import deque

from dilocox.server.shard_records import Snapshot

Contributions = dict  # SliceKey -> {cluster: Contribution}, as a round's accumulator holds them


class RecentRounds:
    def __init__(self, keep_rounds: int) -> None:
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be ≥ 1 (the newest version's contributions), got {keep_rounds}")
        self.keep_rounds = keep_rounds
        self._older: deque[tuple[int, Contributions]] = deque(maxlen=keep_rounds - 1)  # oldest first
        self._lock = threading.Lock()

    def published(self, previous: Snapshot | None, snapshot: Snapshot) -> None:
        """`snapshot` replaces `previous` as the newest version: keep the previous one's contributions when
        the new one follows it (a restore or a jump starts the chain over)."""
        with self._lock:
            if previous is not None and snapshot.version == previous.version + 1:
                self._older.append((previous.version, previous.contributions))
            else:
                self._older.clear()

    def since(self, have: int, snapshot: Snapshot) -> list[tuple[int, Contributions]] | None:
        """(version, contributions) of every version after `have` up to `snapshot`'s, oldest first; None
        when they are not all kept or `have` is not behind."""
        if have < 0 or have >= snapshot.version:
            return None
        with self._lock:
            kept = dict(self._older)
        kept[snapshot.version] = snapshot.contributions
        wanted = range(have + 1, snapshot.version + 1)
        if any(version not in kept for version in wanted):
            return None
        return [(version, kept[version]) for version in wanted]

    def bytes_kept(self, newest: Snapshot | None) -> int:
        """Payload bytes of the kept contributions, the newest version's included."""
        with self._lock:
            rounds = [contributions for _, contributions in self._older]
        if newest is not None:
            rounds.append(newest.contributions)
        return sum(len(c.slice.payload) for per_key in rounds for per_cluster in per_key.values() for c in per_cluster.values())
