"""A cluster's replay of the shards' outer step: folding one shard's pull into the cluster's copy.

A pull brings either the shard's weights (and momentum) in full, or the rounds the cluster is behind on
(one in steady state; a few after a restart from a checkpoint that holds the replica): the clusters'
forwarded contributions — for the newest round of a cluster one version behind, a summary of its own
part, which it takes from the copies it kept when pushing. Replaying the shard's arithmetic on them
(`aggregation.apply_round`) gives the shard's new weights bit for bit. Plain functions over the
client's state, kept apart from the transport (`aggregator_client`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

from dilocox.common.wire.aggregation import Contribution, apply_round, decode_by_blocks
from dilocox.common.wire.framing import EncodedSlice, SliceKey, own_contribution_digest
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.common.wire.slice_assembly import Assembled
from dilocox.proto import dilocox_pb2 as pb


class StaleReplica(RuntimeError):
    """Our copy cannot replay a forwarded round (e.g. our own contribution is gone): pull in full."""


@dataclass(frozen=True)
class OwnPart:
    """Our own contribution to a forwarded round, from the slices we kept when pushing."""

    cluster: str
    weight: float
    slices: dict[SliceKey, EncodedSlice]
    version: int  # the round's version (the newest the shard forwards)
    scale: float = 1.0  # the shards' clip factor of it (proto `scale`; 0 on the wire: 1)


def own_contributions(
    cluster: str,
    kept: Mapping[SliceKey, EncodedSlice],
    held: Mapping[SliceKey, torch.Tensor],
    shard: int,
    summaries: list[pb.TensorChunk],
    keys: list[SliceKey],
    have: int,
) -> OwnPart | None:
    """Our own part of the round the shard forwards, from the copies we `kept` when pushing — after
    checking the shard's summary (count and combined digest) against them."""
    if not summaries:
        return None
    if len(summaries) > 1:
        raise ValueError(f"shard {shard} sent {len(summaries)} summaries of our own contribution")
    summary = summaries[0]
    if summary.base_version != summary.version - 1 or summary.base_version < have:
        raise ValueError(
            f"shard {shard} sent round {summary.version} for version {summary.base_version}; we hold {have}"
        )
    mine = {k: kept[k] for k in keys if k in kept}
    if any(k not in held for k in mine):
        raise StaleReplica(f"shard {shard} forwards a round for slices we hold no weights of")
    if (
        summary.own_slices != len(mine)
        or own_contribution_digest({k: v.sha256 for k, v in mine.items()}) != summary.payload_sha256
    ):
        raise StaleReplica(
            f"shard {shard} holds a contribution of ours ({summary.own_slices} slices) we no longer have"
        )
    return OwnPart(cluster, summary.weight, mine, summary.version, summary.scale or 1.0)


def replayed_version(
    shard: int,
    have: int,
    units: list[Assembled],
    summaries: list[pb.TensorChunk],
    keys: list[SliceKey],
    held: Mapping[SliceKey, torch.Tensor],
) -> int | None:
    """The version our copy reaches by replaying this pull of shard `shard` (to check against its state
    digest), or None when it brought the weights in full. The rounds must be each one since `have`, the
    version we hold; none at all means the shard holds `have` too (a restart that missed nothing)."""
    full = [u for u in units if not u.meta.is_delta]
    if full:
        if len(full) != len(units) or summaries:
            raise ValueError(f"shard {shard} sent weights and rounds to replay in one pull")
        return None
    versions = sorted({u.meta.version for u in units} | {c.version for c in summaries})
    if not versions:
        if have < 0 or any(key not in held for key in keys):
            raise StaleReplica(f"shard {shard} sent nothing for version {have}, and we hold no whole copy of it")
        return have
    if versions != list(range(have + 1, versions[-1] + 1)):
        raise ValueError(f"shard {shard} sent rounds {versions} on version {have}: not each round since")
    return versions[-1]


def apply_pull(
    held: MutableMapping[SliceKey, torch.Tensor],
    outer: OuterNesterov,
    units: list[Assembled],
    own: OwnPart | None,
    version: int,
) -> int:
    """Fold one shard's pull into `held`: full weights (+ momentum), or the rounds to replay, oldest first
    (each round's forwarded contributions; `own`, our part of the newest round, where the shard sent only
    its summary; a round only we contributed to comes as that alone). Returns the version `held` is at for
    this shard's slices. A slice's contributions are taken together when they are all fp32 (views of their
    payloads) or low rank (their factors, built block by block), else decoded one at a time."""
    rounds: dict[int, dict[SliceKey, list[Contribution]]] = {}
    codecs: dict[int, dict[SliceKey, list[str]]] = {}
    clipped: dict[
        int, dict[str, float]
    ] = {}  # round -> cluster -> the shard's clip factor (the same on all its slices)
    if own is not None:
        rounds[own.version] = {key: [(own.cluster, own.weight, item.decode_lazy)] for key, item in own.slices.items()}
        codecs[own.version] = {key: [item.codec] for key, item in own.slices.items()}
        if own.scale != 1.0:
            clipped.setdefault(own.version, {})[own.cluster] = own.scale
    for unit in units:
        meta, key = unit.meta, unit.key
        if meta.is_delta:
            rounds.setdefault(meta.version, {}).setdefault(key, []).append(
                (meta.contributor, meta.weight, unit.decode_lazy)
            )
            codecs.setdefault(meta.version, {}).setdefault(key, []).append(meta.codec)
            if meta.scale and meta.scale != 1.0:
                clipped.setdefault(meta.version, {})[meta.contributor] = meta.scale
        elif meta.momentum:
            outer.buffers[key] = unit.decode().clone()
        else:
            held[key] = unit.decode()
            outer.buffers.pop(key, None)  # a full slice comes with its momentum, if it has any
        version = meta.version  # in full: the shard's version, whatever ours was (a shard restored older)
    # The shard's arithmetic, block by block (same bits), in place: a new θ and momentum per round cost two
    # model-sized first touches (~1.8 ns per parameter each on one core, more than the step itself), and
    # nothing reads the replica while a pull runs (the training thread copies from it at the boundary).
    for round_version in sorted(rounds):
        for key, items in rounds[round_version].items():
            together = decode_by_blocks(codecs[round_version][key])
            held[key] = apply_round(
                items, outer, key, held[key], in_place=True, decode_together=together, scales=clipped.get(round_version)
            )
        version = round_version  # oldest first: the last is the newest
    return version
