"""The shard's rounds chain: one hash-chained record per published version (common/wire/rounds_chain.py).

What a record holds: for version 0 the initialiser; for a closed round each merged site's name, its
tokens as it said them and the weight the shard gave it (a stale contribution's is capped), its staleness,
how many slices and payload bytes it delivered and their SHA-256 (`framing.own_contribution_digest` over the
per-slice payload digests: the value a site computes over what it pushed, so a site can find its own
contribution in the chain), who was late or dropped and the grace window; for every version the state
digest of the shard's weights and outer momentum and the digest of its weights alone (an export checks the
exported weights against it), both XXH3-128 per slice (common/wire/replica_digest.py).

Cost: the payload digests are taken when a push is committed, on its own thread and outside the shard's
lock (`digest_payloads`); the state digest is the one a site's replay check asks for anyway, computed at
the close instead of the first pull and cached on the version for those pulls; the weights digest hashes
the weights once more. Records are a few hundred bytes per site and round: kept in memory, served to
`dilocox export` (the `Provenance` RPC) and saved in every checkpoint (server/state/checkpoint.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import structlog
import torch

from dilocox.common.wire.framing import EncodedSlice, SliceKey, own_contribution_digest
from dilocox.common.wire.replica_digest import XXH3_128, combined_digest, slice_digest
from dilocox.common.wire.rounds_chain import CHAIN_FORMAT, HASH_FIELD, check_chain, genesis, link
from dilocox.server.rounds.round_close import CloseDecision
from dilocox.server.rounds.round_state import RoundAccumulator
from dilocox.server.shard_records import Snapshot

log = structlog.get_logger("dilocox.shard")
DIGEST = XXH3_128  # how the chain's state and weights digests hash each slice
PAGE_BYTES = 1 << 20  # about how much JSON one Provenance reply carries


@dataclass(frozen=True)
class VersionDigests:
    """A version's digests: per slice (weights and momentum, as a replay check asks for them: cached on the
    published version), and combined over the shard's slices, with and without the momentum."""

    per_slice: dict[tuple[str, SliceKey], bytes]  # (digest function, slice) -> digest: `Snapshot.digests` entries
    state: str  # "xxh3-128:<hex>": weights and outer momentum
    weights: str  # "xxh3-128:<hex>": weights alone


def version_digests(
    tensors: Mapping[SliceKey, torch.Tensor], momentum: Mapping[SliceKey, torch.Tensor]
) -> VersionDigests:
    per_slice = {key: slice_digest(key, tensor, momentum.get(key), DIGEST) for key, tensor in tensors.items()}
    weights = combined_digest({key: slice_digest(key, tensor, None, DIGEST) for key, tensor in tensors.items()})
    return VersionDigests(
        {(DIGEST, key): d for key, d in per_slice.items()},
        f"{DIGEST}:{combined_digest(per_slice).hex()}",
        f"{DIGEST}:{weights.hex()}",
    )


def weights_digest(slices: Iterable[tuple[SliceKey, torch.Tensor]]) -> str:
    """The digest of weights alone that a record holds, from (slice, fp32 weights) pairs: what an export checks."""
    return f"{DIGEST}:{combined_digest({key: slice_digest(key, tensor, None, DIGEST) for key, tensor in slices}).hex()}"


def digest_payloads(slices: Iterable[EncodedSlice]) -> None:
    """Hash each pushed payload now (the digest is kept on the slice): called as a push is committed, on its
    thread and before the shard's lock, so the close reads the digests instead of hashing under it."""
    for item in slices:
        item.sha256  # noqa: B018 - computed and cached


def _at() -> float:
    return round(time.time(), 3)


def init_record(initialiser: str, digests: VersionDigests, outer: tuple[float, float]) -> dict:
    return {
        "kind": "init",
        "version": 0,
        "round": 0,
        "initialiser": initialiser,
        "outer_lr": outer[0],
        "outer_momentum": outer[1],
        "state_digest": digests.state,
        "weights_digest": digests.weights,
        "at": _at(),
    }


def restored_record(version: int, digests: VersionDigests, outer: tuple[float, float]) -> dict:
    """The first record of a chain restarted by a restore from a checkpoint that held none (written before
    the chain): it says the versions before it are not recorded, and what state the shard went on from."""
    return {
        "kind": "restored",
        "version": version,
        "round": version,
        "outer_lr": outer[0],
        "outer_momentum": outer[1],
        "note": "restored from a checkpoint without a rounds chain: the versions before this one are not recorded",
        "state_digest": digests.state,
        "weights_digest": digests.weights,
        "at": _at(),
    }


def round_record(
    acc: RoundAccumulator, decision: CloseDecision, digests: VersionDigests, check: Mapping | None = None
) -> dict:
    """The record of a closed round, from its sealed accumulator (the weights as the close used them) and
    decision: the sites whose contributions it holds are the ones merged; `left_out`, those the decision
    included whose contributions were taken out before the step (an update check). `check`: what an update
    check found, where one ran."""
    sites = []
    for cluster in sorted(set(decision.include) & set(acc.cluster_weights)):
        mine = [per[cluster] for _, per in sorted(acc.contributions.items()) if cluster in per]
        sites.append(
            {
                "cluster": cluster,
                "tokens": acc.cluster_weights.get(cluster, mine[0].weight if mine else 0.0),
                "weight": mine[0].weight if mine else 0.0,
                "staleness": acc.cluster_ages.get(cluster, 0),
                **(
                    {"staleness_said": acc.declared_ages[cluster]} if cluster in acc.declared_ages else {}
                ),  # understated: the age used is above
                "slices": len(mine),
                "payload_bytes": sum(len(c.slice.payload) for c in mine),
                "codecs": sorted({c.slice.codec for c in mine}),
                "payload_sha256": own_contribution_digest({c.slice.key: c.slice.sha256 for c in mine}).hex(),
                **({"scale": mine[0].scale} if mine and mine[0].scale != 1.0 else {}),  # merged as scale·Δ (clipped)
            }
        )
    record = {
        "kind": "round",
        "version": acc.round,
        "round": acc.round,
        "sites": sites,
        "late": list(decision.late),
        "dropped": list(decision.dropped),
        "left_out": sorted(set(decision.include) - set(acc.cluster_weights)),
        "grace_s": decision.grace_s,
        "state_digest": digests.state,
        "weights_digest": digests.weights,
        "at": _at(),
    }
    if check is not None:
        record["check"] = dict(check)
    return record


@dataclass(frozen=True)
class ChainedVersion:
    """A closed round's record and digests, made outside the shard's lock; appended as it is published."""

    record: dict
    digests: dict[tuple[str, SliceKey], bytes]  # per slice, for the version's `Snapshot.digests`
    seconds: float  # what making them took (the digests, mostly)


def chain_round(
    acc: RoundAccumulator,
    decision: CloseDecision,
    tensors: Mapping[SliceKey, torch.Tensor],
    momentum: Mapping[SliceKey, torch.Tensor],
    check: Mapping | None = None,
) -> ChainedVersion:
    """The record of a round just stepped to `tensors` and `momentum` (call without the lock: only the
    closing thread touches the sealed round and the stepped state until it is published). `check`: the
    update check's verdicts, by site (server/checks/update_check.py)."""
    started = time.perf_counter()
    digests = version_digests(tensors, momentum)
    record = round_record(acc, decision, digests, check)
    return ChainedVersion(record, digests.per_slice, time.perf_counter() - started)


class RoundsChain:
    """One shard's chain: its records (each with its hash), in memory. Not thread-safe: the shard appends
    and reads it under its lock."""

    def __init__(self, run_id: str, shard_index: int, num_shards: int, entries: Iterable[dict] = ()) -> None:
        self.run_id, self.shard_index, self.num_shards = run_id, shard_index, num_shards
        self.genesis = genesis(run_id, shard_index, num_shards)
        self.entries: list[dict] = list(entries)

    @property
    def head(self) -> str:
        return self.entries[-1][HASH_FIELD] if self.entries else self.genesis

    @property
    def version(self) -> int | None:
        return self.entries[-1]["version"] if self.entries else None

    def append(self, record: dict) -> dict:
        entry = {**record, HASH_FIELD: link(self.head, record)}
        self.entries.append(entry)
        log.info(
            "provenance_appended",
            shard=self.shard_index,
            version=record["version"],
            kind=record["kind"],
            sites=[s["cluster"] for s in record.get("sites", ())],
            head=entry[HASH_FIELD][:16],
        )
        return entry

    def as_state(self) -> dict:
        """What a checkpoint saves (plain values: the checkpoint's integrity digest covers them)."""
        return {"format": CHAIN_FORMAT, "genesis": self.genesis, "records": list(self.entries), "head": self.head}

    def page(self, start: int, max_bytes: int = PAGE_BYTES) -> list[dict]:
        """The records from `start`, as many as fit about `max_bytes` of JSON (at least one)."""
        if not 0 <= start <= len(self.entries):
            raise IndexError(f"record {start} outside the chain's 0..{len(self.entries)}")
        out, size = [], 0
        for entry in self.entries[start:]:
            size += len(json.dumps(entry)) + 2
            if out and size > max_bytes:
                break
            out.append(entry)
        return out

    @classmethod
    def restored(
        cls, saved: dict | None, run_id: str, shard_index: int, num_shards: int, version: int | None
    ) -> RoundsChain:
        """The chain a checkpoint saved, recomputed before it is trusted (`ValueError` naming the record that
        does not), or an empty one for a checkpoint from before the chain (the caller then starts a segment)."""
        chain = cls(run_id, shard_index, num_shards)
        if saved is None or (not saved.get("records") and version is None):
            return chain
        records = saved.get("records")
        problems = check_chain(
            run_id, shard_index, num_shards, records or [], saved.get("head", ""), end_version=version
        )
        if problems:
            raise ValueError(f"the checkpoint's {problems[0]}")
        chain.entries = [dict(entry) for entry in records]
        return chain


def resume_chain(
    saved: dict | None,
    run_id: str,
    shard_index: int,
    num_shards: int,
    snapshot: Snapshot | None,
    outer: tuple[float, float],
) -> RoundsChain:
    """A restored shard's chain: the checkpoint's, recomputed (`ValueError` if it does not, or does not end at
    the restored version); for a checkpoint from before the chain, a new segment whose first record says the
    shard was restored without history, with the digests of the state it goes on from."""
    chain = RoundsChain.restored(saved, run_id, shard_index, num_shards, None if snapshot is None else snapshot.version)
    if snapshot is not None and not chain.entries:
        digests = version_digests(snapshot.tensors, snapshot.momentum)
        snapshot.digests.update(digests.per_slice)
        chain.append(restored_record(snapshot.version, digests, outer))
        log.warning(
            "provenance_segment_started",
            shard=shard_index,
            version=snapshot.version,
            reason="the checkpoint holds no rounds chain (written before it): the versions before this one are not "
            "recorded",
        )
    return chain
