"""How a shard serves pulls (the half of `Shard` that hands out published versions): the wait for a version,
holding it while a pull streams it, its state digest, the rounds chain's pages, and what pulls report back
(replay mismatches, who holds the final version). Mixed into `Shard` as `RoundClosing` is, using its state
and lock (`_cond`, `snapshot`, `members`, `_readers`, …) defined in `Shard.__init__`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import structlog

from dilocox.common.wire.errors import InvalidFrame, NotJoined, NotReady, RoundNotOpen, ShuttingDown
from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.replica_digest import combined_digest, slice_digest
from dilocox.server.shard_records import Snapshot
from dilocox.server.state.provenance_chain import PAGE_BYTES

log = structlog.get_logger("dilocox.shard")


class PullServing:
    """Mixed into `Shard`: the pull side of its core."""

    def wait_for_version(
        self, run_id: str, cluster: str, min_version: int, timeout: float, observer: bool = False, hold: bool = False
    ) -> Snapshot:
        """Block until the shard publishes at least `min_version` (or refuse after `timeout` seconds).
        An `observer` needs no membership (it only reads). `hold`: the caller streams the snapshot's
        tensors and must `release` it after; until then no close updates them in place."""
        self._check_run(run_id)
        with self._cond:
            if not observer and cluster not in self.members:
                raise NotJoined(f"cluster {cluster!r} has not joined shard {self.shard_index}")
            if not observer and self.snapshot is not None and min_version > self.open_round:
                # The cluster pushed round min_version, so it saw version min_version − 2 at least: this
                # shard went back (restored from an older checkpoint). Waiting could only time out.
                raise RoundNotOpen(
                    f"shard {self.shard_index} holds version {self.version}: round {min_version} cannot close here "
                    "before "
                    f"rounds {self.open_round}–{min_version - 1}; rejoin at its version"
                )

            def have() -> bool:
                if self._round_closing is not None and self._round_closing.in_place:
                    return False  # the current version is being updated in place: the next one comes soon
                return self.snapshot is not None and self.snapshot.version >= min_version

            ready = self._cond.wait_for(lambda: have() or self.closing, timeout)
            if self.closing and not have():
                raise ShuttingDown(f"shard {self.shard_index} is shutting down; retry")
            if not ready:
                raise NotReady(
                    f"shard {self.shard_index} holds version {self.version}, not {min_version}, after waiting "
                    f"{timeout:.1f}s"
                )
            assert self.snapshot is not None
            if hold:
                self._readers[id(self.snapshot)] = self._readers.get(id(self.snapshot), 0) + 1
            return self.snapshot

    def release(self, snapshot: Snapshot) -> None:
        """A pull that held `snapshot` (wait_for_version(hold=True)) is done with it."""
        with self._cond:
            left = self._readers.get(id(snapshot), 0) - 1
            if left > 0:
                self._readers[id(snapshot)] = left
            else:
                self._readers.pop(id(snapshot), None)

    def state_digest(self, snapshot: Snapshot, keys: Sequence[SliceKey], digest: str = "") -> bytes:
        """The digest of `keys`' weights and momentum at `snapshot`, each slice hashed by `digest`
        (common/wire/replica_digest.py); each slice is hashed once per version and function, when a
        cluster first asks (xxh3-128 ≈ 10× sha256's ≈ 1.7 GB/s on one core)."""
        with self._digest_lock:
            for key in keys:
                if (digest, key) not in snapshot.digests:
                    snapshot.digests[digest, key] = slice_digest(
                        key, snapshot.tensors[key], snapshot.momentum.get(key), digest
                    )
            return combined_digest({key: snapshot.digests[digest, key] for key in keys})

    def provenance(self, run_id: str, start: int = 0, max_bytes: int = 0) -> tuple[list[dict], int, str]:
        """A page of the rounds chain from record `start` (`Provenance` RPC): (records, records in the chain,
        its head)."""
        self._check_run(run_id)
        with self._cond:
            try:
                return self.chain.page(start, max_bytes or PAGE_BYTES), len(self.chain.entries), self.chain.head
            except IndexError as error:
                raise InvalidFrame(str(error)) from None

    def note_replay_mismatches(self, cluster: str, count: int) -> None:
        if count > 0:
            with self._cond:
                self.replay_mismatches[cluster] = max(count, self.replay_mismatches.get(cluster, 0))

    def note_pulled(self, cluster: str, version: int, names: Iterable[str]) -> None:
        """A member received `version` of `names` (a pipeline's ranks each pull their share); the run is
        over for this shard once every member holds the final version of every slice it owns."""
        final = self.final_version
        with self._cond:
            if version > self.held_by.get(cluster, -1):  # what its next push's work can at most be trained from
                self.held_by[cluster] = version
            if final is None or version < final or cluster not in self.members:
                return
            owned = {key.name for key in self.owned}
            self.pulled_final.setdefault(cluster, set()).update(set(names) or owned)
            done = all(owned <= self.pulled_final.get(member, set()) for member in self.members)
        if done and self.on_finished is not None:
            log.info("run_finished", shard=self.shard_index, version=version, clusters=sorted(self.members))
            self.on_finished()
