"""The shards' rounds chains in an export: read from the shards or their checkpoints, written into
provenance.json as `rounds_chain`, and recomputed by `dilocox verify` (common/wire/rounds_chain.py).

Why in provenance.json: the signature covers that file, so a signed export carries each shard's own
account of how every version up to the exported one was made — which sites' payloads (by SHA-256), with
what tokens and weights, who was late or dropped — and a changed, removed or reordered record is found by
`dilocox verify`, named by its shard and version. Each shard's last record also holds the digest of its
weights, which verify recomputes from model.safetensors: the exported weights are the state the chains end in.

`rounds_chain`:

    {"format": "dilocox-rounds-chain/1", "shards": [
        {"shard_index": i, "num_shards": n, "genesis": <hex>, "head": <hex>,
         "slices": [[name, row_start, row_stop], ...], "records": [{..., "hash": <hex>}, ...]}
        or {"shard_index": i, "missing": <why>}, ...]}
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.replica_digest import XXH3_128, combined_digest, slice_digest
from dilocox.common.wire.rounds_chain import CHAIN_FORMAT, HASH_FIELD, check_chain
from dilocox.proto import dilocox_pb2 as pb

PAGES_MAX = 100_000  # a shard that never ends its chain is refused, not followed for ever


class ChainError(ValueError):
    """A shard's chain could not be read (the export says why and stops)."""


def fetch_chain(stub, run_id: str, timeout: float) -> dict | None:  # noqa: ANN001
    """A live shard's whole chain, page by page (`Provenance` RPC); None from a shard that predates it
    (UNIMPLEMENTED). Other RPC errors propagate: the export reports them like a failed pull."""
    records: list[dict] = []
    reply = None
    for _ in range(PAGES_MAX):
        try:
            reply = stub.Provenance(pb.ProvenanceRequest(run_id=run_id, start=len(records)), timeout=timeout)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
        page = json.loads(reply.records_json or "[]")
        records += page
        if len(records) >= reply.total_records or not page:
            break
    assert reply is not None
    return {
        "shard_index": reply.shard_index,
        "num_shards": reply.num_shards,
        "genesis": reply.genesis,
        "records": records,
    }


def chain_of_checkpoint(state: Mapping[str, Any]) -> dict | None:
    """A checkpoint's chain (its digest was checked when it was loaded); None for a file from before it."""
    saved = state.get("rounds_chain")
    if not saved:
        return None
    return {
        "shard_index": state["shard_index"],
        "num_shards": state["num_shards"],
        "genesis": saved.get("genesis", ""),
        "records": list(saved.get("records", [])),
    }


def export_section(chains: Mapping[int, dict | None], version: int, assignment: Iterable[ParamSlice]) -> dict:
    """provenance.json's `rounds_chain`: each shard's records up to the exported `version` (a live shard may
    have published more since its weights were read), its head, and the slices it owns (what verify hashes
    the exported weights by). Empty when no shard kept a chain (shards or checkpoints from before it)."""
    if not any(chains.values()):
        return {}
    owned: dict[int, list[list]] = {}
    for s in assignment:
        owned.setdefault(s.shard, []).append([s.name, s.row_start, s.row_stop])
    shards = []
    for index, chain in sorted(chains.items()):
        if chain is None:
            shards.append(
                {"shard_index": index, "missing": "this shard kept no rounds chain (a dilocox from before it)"}
            )
            continue
        records = [r for r in chain["records"] if not isinstance(r.get("version"), int) or r["version"] <= version]
        head = records[-1].get(HASH_FIELD, "") if records else chain["genesis"]
        shards.append(
            {
                "shard_index": index,
                "num_shards": chain["num_shards"],
                "genesis": chain["genesis"],
                "head": head,
                "slices": sorted(owned.get(index, [])),
                "records": records,
            }
        )
    return {"format": CHAIN_FORMAT, "shards": shards}


@dataclass
class ChainReport:
    """What verify found in `rounds_chain`: problems fail the check; notes are said, and do not."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: str = ""


def check_section(record: Mapping[str, Any], weights: pathlib.Path | None = None) -> ChainReport:
    """Recompute every shard's chain in a provenance record (`record`: provenance.json, parsed) against its
    run id and exported version; with `weights` (model.safetensors), also each shard's weights digest."""
    report = ChainReport()
    section = record.get("rounds_chain")
    if not section:
        report.notes.append(
            "no rounds chain in provenance.json (exported by a dilocox before it, or from shards that kept none)"
        )
        return report
    run_id, version = record.get("run_id"), record.get("version")
    shards = section.get("shards") if isinstance(section, Mapping) else None
    if not isinstance(shards, list) or section.get("format") != CHAIN_FORMAT or not shards:
        report.problems.append(f"rounds_chain is malformed (expected {CHAIN_FORMAT} with a list of shards)")
        return report
    num_shards = next(
        (s.get("num_shards") for s in shards if isinstance(s, Mapping) and "num_shards" in s), len(shards)
    )
    indices = [s.get("shard_index") if isinstance(s, Mapping) else None for s in shards]
    if sorted(i for i in indices if isinstance(i, int)) != list(range(num_shards)) or len(indices) != num_shards:
        report.problems.append(f"rounds_chain lists shards {indices}, not each of the {num_shards} shards once")
        return report
    checked = []
    for shard in shards:
        index = shard["shard_index"]
        if "missing" in shard:
            report.notes.append(f"shard {index}: no rounds chain ({shard['missing']})")
            continue
        if shard.get("num_shards") != num_shards:
            report.problems.append(
                f"rounds chain of shard {index}: num_shards {shard.get('num_shards')!r}, the others say {num_shards}"
            )
            continue
        records = shard.get("records") or []
        found = check_chain(str(run_id), index, num_shards, records, shard.get("head", ""), end_version=version)
        report.problems += [str(p) for p in found]
        if not found:
            checked.append(shard)
            if records[0].get("kind") == "restored":
                report.notes.append(
                    f"shard {index}: versions before {records[0]['version']} not recorded (restored from a "
                    "checkpoint without a rounds chain)"
                )
    if weights is not None and checked:
        report.problems += _check_weights(weights, checked, version)
    if not report.problems:
        first = min((s["records"][0]["version"] for s in checked), default=version)
        bound = " and the exported weights are the state they end in" if weights is not None and checked else ""
        report.summary = (
            f"rounds chain: {len(checked)} of {num_shards} shard(s), versions {first}–{version}, every record and "
            f"head recomputes{bound}"
        )
    return report


def _check_weights(path: pathlib.Path, shards: list[Mapping[str, Any]], version: Any) -> list[str]:
    """Each shard's weights digest (its chain's last record) against its slices of the exported weights."""
    from safetensors import SafetensorError, safe_open

    wanted: dict[str, list[tuple[int, SliceKey]]] = {}
    for shard in shards:
        for name, start, stop in shard.get("slices", []):
            wanted.setdefault(name, []).append((shard["shard_index"], SliceKey(name, start, stop)))
    per_shard: dict[int, dict[SliceKey, bytes]] = {s["shard_index"]: {} for s in shards}
    try:
        with safe_open(str(path), framework="pt") as weights:
            present = set(weights.keys())
            for name, slices in wanted.items():
                if name not in present:
                    return [f"{path.name}: has no parameter {name!r}, which the rounds chain's slices name"]
                full = weights.get_tensor(name)
                for index, key in slices:
                    part = ParamSlice(name, tuple(full.shape), key.row_start, key.row_stop, index).view(full)
                    per_shard[index][key] = slice_digest(key, part, None, XXH3_128)
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:  # a damaged header is safetensors' own error
        return [f"{path.name}: cannot be read to check it against the rounds chain ({error})"]
    problems = []
    for shard in shards:
        index, last = shard["shard_index"], shard["records"][-1]
        found = f"{XXH3_128}:{combined_digest(per_shard[index]).hex()}"
        if last.get("weights_digest") != found:
            problems.append(
                f"rounds chain of shard {index} version {version}: the exported weights of its slices are not the "
                f"state its chain ends in (weights digest {found[:25]}…, recorded "
                f"{str(last.get('weights_digest'))[:25]}…)"
            )
    return problems
