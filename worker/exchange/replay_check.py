"""Checking a cluster's replay of the outer step against the shard, and resyncing when it differs.

A cluster one version behind gets the round's contributions and replays the shard's outer step on its
own copy of θ and the momentum. With `wire.replay_check` on (the default) it also asks for the shard's
state digest of those slices (common/wire/replica_digest.py) and compares its result: on a mismatch the
slices are pulled in full before the next round (`replay_mismatch` in the log, a counter in the
worker's metrics and, reported with its pulls, in `dilocox status`). A cluster that differs round after
round says why that is likely, instead of resyncing silently forever.
"""

from __future__ import annotations

import structlog
import torch

from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.replica_digest import DIGEST_BYTES, XXH3_128, state_digest
from dilocox.proto import dilocox_pb2 as pb

log = structlog.get_logger()

PERSISTENT_AFTER = 3  # consecutive mismatching versions of one shard before the warning


class ReplayMismatch(RuntimeError):
    """Our replay of a shard's step differs from the shard's state: pull those slices in full."""


class ReplayCheck:
    def __init__(self, enabled: bool = True, cluster: str = "") -> None:
        self.enabled = enabled
        self.cluster = cluster
        self.digest = XXH3_128  # how the shard is asked to hash each slice (common/wire/replica_digest.py)
        self.mismatches = 0  # over the run: what the Prometheus counter and `dilocox status` show
        self.checked = 0
        self._streak: dict[int, int] = {}  # shard -> consecutive mismatching versions
        self._replayed: dict[int, tuple[int, dict[SliceKey, torch.Tensor]]] = {}  # shard -> (version, our copy)

    def expected(self, shard: int, digests: list[pb.TensorChunk], replayed_version: int | None) -> bytes | None:
        """The digest to compare with once the replay of `replayed_version` is applied (None: nothing to
        check). Called before anything is applied: a shard that replays without a valid digest is refused."""
        if not self.enabled or replayed_version is None:
            return None
        if len(digests) != 1:
            raise ValueError(
                f"shard {shard} sent {len(digests)} state digests with round {replayed_version}, expected 1: "
                "a shard too old for the replay check, or a broken stream (turn the check off with "
                "--wire-replay-check false only if every shard is older)"
            )
        chunk = digests[0]
        if len(chunk.payload_sha256) != DIGEST_BYTES or chunk.version != replayed_version:
            raise ValueError(
                f"shard {shard} sent a malformed state digest ({len(chunk.payload_sha256)} bytes, version "
                f"{chunk.version}) with round {replayed_version}"
            )
        return bytes(chunk.payload_sha256)

    def verify(
        self, shard: int, version: int, keys: list[SliceKey], held: dict, momentum: dict, expected: bytes
    ) -> None:
        """Compare our replayed state of `keys` with the shard's digest; raises ReplayMismatch (after
        keeping our copy, to report how far it was off) when they differ."""
        self.checked += 1
        if state_digest(keys, held, momentum, self.digest) == expected:
            self._streak.pop(shard, None)
            return
        self.mismatches += 1
        self._streak[shard] = self._streak.get(shard, 0) + 1
        self._replayed[shard] = (version, {key: held[key].clone() for key in keys})
        raise ReplayMismatch(f"our replay of shard {shard}'s version {version} differs from its state digest")

    def resynced(self, shard: int, held: dict) -> None:
        """The slices came in full after a mismatch: log by how much our replay was off."""
        version, ours = self._replayed.pop(shard, (None, {}))
        diffs = [float((ours[key] - held[key]).abs().max()) for key in ours if key in held and ours[key].numel()]
        log.warning(
            "replay_mismatch",
            cluster=self.cluster,
            shard=shard,
            version=version,
            slices=len(ours),
            max_abs_diff=max(diffs, default=None),
            mismatches=self.mismatches,
            resync="full pull",
        )
        streak = self._streak.get(shard, 0)
        if streak == PERSISTENT_AFTER:
            log.warning(
                "replay_mismatch_persistent",
                cluster=self.cluster,
                shard=shard,
                rounds=streak,
                reason="this cluster replays the outer step differently from the shard every round: most "
                "likely another CPU kind or torch build than the shard's. Each round now costs a "
                "full pull of the weights and momentum; run the shards and sites on one torch "
                "version, or accept the cost",
            )
