"""The rounds chain: a shard's own account of how each version it published was made, hash-chained.

Why: an exported model says which run and version it is (provenance.json), but not what made that version.
Each shard keeps, per published version, a record — the sites it merged, their tokens and the weight it
gave them, the SHA-256 of their payloads, who was late or dropped, and the digest of the weights and outer
momentum that resulted — and chains the records: each record's hash is SHA-256(previous hash ‖ canonical
JSON of the record), starting from a genesis hash bound to the run id, the shard's index and the shard
count. Changing, removing or reordering a record changes every hash after it, so a chain whose head is
signed (the export's provenance.json) or known (the live shard's) cannot be edited unnoticed.

What it proves: the shards' own account of which sites' payloads (by digest) made each version, and — by
the weights digest of its last record — that an export's weights are the state the chain ends in. What it
does not: that those payloads were honest training (an update check's job), or anything a shard lied about.

Pure functions: the shard appends (server/state/provenance_chain.py), `dilocox verify` recomputes
(worker/export/chain.py), with exactly these.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CHAIN_FORMAT = "dilocox-rounds-chain/1"
HASH_FIELD = "hash"  # each entry: the record's fields plus its chain hash (left out of what is hashed)
KINDS = ("init", "round", "restored")  # version 0; a closed round; a restore from a checkpoint without a chain


def canonical(record: Mapping[str, Any]) -> bytes:
    """The record as hashed: JSON with sorted keys, no spaces, UTF-8; NaN and Infinity refused (not JSON)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def genesis(run_id: str, shard_index: int, num_shards: int) -> str:
    """The hash a shard's chain starts from: binds every record after it to this run and shard."""
    return hashlib.sha256(
        canonical({"format": CHAIN_FORMAT, "run_id": run_id, "shard_index": shard_index, "num_shards": num_shards})
    ).hexdigest()


def link(previous: str, record: Mapping[str, Any]) -> str:
    """SHA-256(previous hash's bytes ‖ canonical JSON of `record`), hex."""
    return hashlib.sha256(bytes.fromhex(previous) + canonical(record)).hexdigest()


def body(entry: Mapping[str, Any]) -> dict:
    """An entry without its hash: what the hash is over."""
    return {k: v for k, v in entry.items() if k != HASH_FIELD}


@dataclass(frozen=True)
class ChainProblem:
    """One thing wrong with a shard's chain, named by the shard and the version of the record."""

    shard: int
    version: int | None  # None: the chain as a whole (its head, its end, its shape)
    what: str

    def __str__(self) -> str:
        where = f"shard {self.shard}" + ("" if self.version is None else f" version {self.version}")
        return f"rounds chain of {where}: {self.what}"


def check_chain(
    run_id: str,
    shard_index: int,
    num_shards: int,
    entries: Sequence[Mapping[str, Any]],
    head: str,
    end_version: int | None = None,
) -> list[ChainProblem]:
    """Recompute a shard's chain from its records: every record's hash from the one before it (a changed
    record is named by its version), the head, versions one apart (starting at 0 with the initial weights,
    or at a restore without history), and — with `end_version` — that the last record is that version.
    Never raises on malformed input: each defect is a problem."""
    problems: list[ChainProblem] = []

    def problem(version: Any, what: str) -> None:
        problems.append(ChainProblem(shard_index, version if isinstance(version, int) else None, what))

    if not isinstance(entries, Sequence) or not entries:
        problem(None, "holds no records")
        return problems
    previous = recomputed = genesis(run_id, shard_index, num_shards)
    last_version = None
    for position, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not isinstance(entry.get(HASH_FIELD), str):
            problem(None, f"record {position} is malformed (no hash)")
            return problems
        version, kind = entry.get("version"), entry.get("kind")
        try:
            expected = link(previous, body(entry))
            recomputed = link(recomputed, body(entry))
        except (TypeError, ValueError) as error:  # a value JSON cannot hold, or a stored hash that is not hex
            problem(version, f"record is malformed ({error})")
            return problems
        if expected != entry[HASH_FIELD]:
            problem(
                version, f"record changed: it hashes to {expected[:16]}…, the chain holds {entry[HASH_FIELD][:16]}…"
            )
        previous = entry[HASH_FIELD]  # later records are judged on their own links
        if not isinstance(version, int) or isinstance(version, bool) or kind not in KINDS:
            problem(version, f"record {position} has no integer version or an unknown kind {kind!r}")
        elif position == 0 and not (kind == "restored" or (kind == "init" and version == 0)):
            problem(
                version,
                f"the chain starts with a {kind} record (expected the initial weights, version 0, or a restore)",
            )
        elif position > 0 and (kind != "round" or last_version is None or version != last_version + 1):
            problem(
                version,
                f"a {kind} record after version {last_version}: versions must follow one another by closed rounds",
            )
        last_version = version if isinstance(version, int) else None
    if recomputed != head:
        problem(None, f"the head does not recompute: {recomputed[:16]}… from the records, {str(head)[:16]}… recorded")
    if end_version is not None and last_version != end_version:
        problem(None, f"the chain ends at version {last_version}, the export is version {end_version}")
    return problems
