"""A cluster's replay of the shards' outer step: folding one shard's pull into the cluster's copy.

A pull brings either the shard's weights (and momentum) in full, or the round the cluster is one version
behind on: the other clusters' forwarded contributions, plus a summary of the cluster's own part, which
it takes from the copies it kept when pushing. Replaying the shard's arithmetic on them
(`aggregation.apply_round`) gives the shard's new weights bit for bit. Plain functions over the
client's state, kept apart from the transport (`aggregator_client`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import torch

from dilocox.common.wire.aggregation import Contribution, apply_round
from dilocox.common.wire.framing import Assembled, EncodedSlice, SliceKey, own_contribution_digest
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.proto import dilocox_pb2 as pb


class StaleReplica(RuntimeError):
    """Our copy cannot replay a forwarded round (e.g. our own contribution is gone): pull in full."""


def own_contributions(
    cluster: str,
    kept: Mapping[SliceKey, EncodedSlice],
    held: Mapping[SliceKey, torch.Tensor],
    shard: int,
    summaries: list[pb.TensorChunk],
    keys: list[SliceKey],
    have: int,
) -> dict[SliceKey, list[Contribution]]:
    """Our own part of the round the shard forwards, from the copies we `kept` when pushing — after
    checking the shard's summary (count and combined digest) against them."""
    if not summaries:
        return {}
    if len(summaries) > 1:
        raise ValueError(f"shard {shard} sent {len(summaries)} summaries of our own contribution")
    summary = summaries[0]
    if summary.base_version != have:
        raise ValueError(f"shard {shard} sent round {summary.version} for version {summary.base_version}; we hold {have}")
    mine = {k: kept[k] for k in keys if k in kept}
    if any(k not in held for k in mine):
        raise StaleReplica(f"shard {shard} forwards a round for slices we hold no weights of")
    if summary.own_slices != len(mine) or own_contribution_digest({k: v.sha256 for k, v in mine.items()}) != summary.payload_sha256:
        raise StaleReplica(f"shard {shard} holds a contribution of ours ({summary.own_slices} slices) we no longer have")
    return {k: [(cluster, summary.weight, item.decode)] for k, item in mine.items()}


def apply_pull(
    held: MutableMapping[SliceKey, torch.Tensor],
    outer: OuterNesterov,
    units: list[Assembled],
    own: Mapping[SliceKey, list[Contribution]] | None,
    version: int,
    dense: bool,
) -> int:
    """Fold one shard's pull into `held`: full weights (+ momentum), or a round to replay (the forwarded
    contributions plus `own`, our part of that round; a round only we contributed to comes as that
    alone). Returns the version `held` is at for this shard's slices. `dense`: every contribution is
    fp32 (decoded as views, so decoded together and the mean fused into the step); otherwise each is
    decoded one at a time."""
    contributions: dict[SliceKey, list[Contribution]] = {k: list(v) for k, v in (own or {}).items()}
    for unit in units:
        meta, key = unit.meta, unit.key
        version = meta.version
        if meta.is_delta:
            contributions.setdefault(key, []).append((meta.contributor, meta.weight, unit.decode))
        elif meta.momentum:
            outer.buffers[key] = unit.decode().clone()
        else:
            held[key] = unit.decode()
            outer.buffers.pop(key, None)  # a full slice comes with its momentum, if it has any
    for key, items in contributions.items():  # the shard's arithmetic, block by block (same bits)
        held[key] = apply_round(items, outer, key, held[key], decode_together=dense)
    return version
