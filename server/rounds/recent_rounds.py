"""The contributions of a shard's newest versions, kept so a site that comes back behind replays them.

A site restarted from its checkpoint holds the replica of the global model at the version it saved
(worker/exchange/replica_state.py). Instead of the weights and momentum in full — 8 bytes per parameter
over the WAN, 856 GB at 107B — it needs only the rounds since, compressed as the clusters pushed them. The
newest version's contributions are in its `Snapshot` already (the steady-state downlink forwards them);
this keeps those of the `keep_rounds - 1` versions before it, without gaps, so a site up to
`keep_rounds` versions behind replays. They cost their compressed bytes (`bytes_kept`, a metric): per
version, the sum over clusters of their pushes to this shard. With a disk (`keep_on_disk`:
server/state/rounds_on_disk.py) every published version's contributions are also kept there for a day by
default, and a version no longer in memory is read back from it.
"""

from __future__ import annotations

import threading
from collections import deque

from dilocox.server.shard_records import Snapshot
from dilocox.server.state.contribution_state import Contributions
from dilocox.server.state.rounds_on_disk import RoundsOnDisk


class RecentRounds:
    def __init__(self, keep_rounds: int) -> None:
        if keep_rounds < 1:
            raise ValueError(f"keep_rounds must be ≥ 1 (the newest version's contributions), got {keep_rounds}")
        self.keep_rounds = keep_rounds
        self._older: deque[tuple[int, Contributions]] = deque(maxlen=keep_rounds - 1)  # oldest first
        self._lock = threading.Lock()
        self.disk: RoundsOnDisk | None = None

    def keep_on_disk(self, disk: RoundsOnDisk, newest: Snapshot | None, resumed: bool) -> None:
        """Keep every version from now on on `disk` as well; it keeps what it holds up to `newest` when the
        shard `resumed` from a checkpoint at it (the same run), else nothing. `newest`'s own contributions go
        to disk too (a restore holds them in its snapshot)."""
        disk.open(newest.version if resumed and newest is not None else None)
        self.disk = disk
        if newest is not None and newest.version not in disk.versions():
            disk.put(newest.version, newest.contributions)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def published(self, previous: Snapshot | None, snapshot: Snapshot) -> None:
        """`snapshot` replaces `previous` as the newest version: keep the previous one's contributions when
        the new one follows it (a restore or a jump starts the chain over)."""
        with self._lock:
            if previous is not None and snapshot.version == previous.version + 1:
                self._older.append((previous.version, previous.contributions))
            else:
                self._older.clear()
        if self.disk is not None:
            self.disk.put(snapshot.version, snapshot.contributions)

    def since(self, have: int, snapshot: Snapshot) -> list[tuple[int, Contributions]] | None:
        """(version, contributions) of every version after `have` up to `snapshot`'s, oldest first; None
        when they are not all kept or `have` is not behind."""
        if have < 0 or have >= snapshot.version:
            return None
        with self._lock:
            kept = dict(self._older)
        kept[snapshot.version] = snapshot.contributions
        wanted = range(have + 1, snapshot.version + 1)
        missing = [version for version in wanted if version not in kept]
        if missing and (self.disk is None or not set(missing) <= self.disk.versions()):
            return None
        for version in missing:  # older than memory holds: read back from the disk
            contributions = self.disk.get(version)
            if contributions is None:
                return None
            kept[version] = contributions
        return [(version, kept[version]) for version in wanted]

    def bytes_kept(self, newest: Snapshot | None) -> int:
        """Payload bytes of the kept contributions, the newest version's included."""
        with self._lock:
            rounds = [contributions for _, contributions in self._older]
        if newest is not None:
            rounds.append(newest.contributions)
        return sum(
            len(c.slice.payload) for per_key in rounds for per_cluster in per_key.values() for c in per_cluster.values()
        )
