"""The site's replica of the global model in its checkpoint, so a restart resumes by delta.

Every cluster keeps a copy of the shards' state for the slices it exchanges — weights, outer momentum and
the version of each shard (`AggregatorClient.held`, `.outer`, `.held_versions`) — and replays each round's
forwarded contributions on it. Saved with the site's checkpoint and installed again at the join, it lets
the first pull after `--resume` ask for only the rounds it missed: the shards keep the last
`--keep-rounds` versions' compressed contributions, and the shard's state digest checks the replay. A
full pull of the weights and momentum (8 bytes per parameter over the WAN: 856 GB at 107B) is left for a
site further behind than the shards keep, a checkpoint without a replica, or a replay that does not match.

In the site's checkpoint each rank writes its replica into a file of its own beside DCP's
(`replica-rank<r>.pt`, `write_replica`), from the live tensors while the pull's fold waits on the client's
lock — no staging copy — keyed by parameter name, so a resume with another layout picks each parameter's
slices from whichever file holds them. The API's `state_dict()` packs it per name like the compressor's
state (`packed_state`). A name's entry holds its slices (those of one shard may be at another version
than those of the next, as a pull left them).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

import torch

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.framing import SliceKey
from dilocox.worker.exchange.packed_state import compact, unpack


def replica_entries(
    held: Mapping[SliceKey, torch.Tensor],
    momentum: Mapping[SliceKey, torch.Tensor],
    versions: Mapping[int, int],
    assignment: Iterable[ParamSlice],
    names: Iterable[str],
) -> dict[str, dict]:
    """Every name in `names`, with the replica's slices of it: weights, momentum (None where the shard
    keeps none) and the version of the shard they came from — the live tensors, not copies (hold the
    client's `replica_lock` while they are read). Slices of a shard with no version yet are left out."""
    by_name: dict[str, dict] = {name: {} for name in names}
    for piece in assignment:
        version = versions.get(piece.shard, -1)
        if piece.name in by_name and piece.key in held and version >= 0:
            by_name[piece.name][piece.key] = {
                "weights": held[piece.key],
                "momentum": momentum.get(piece.key),
                "shard": piece.shard,
                "version": version,
            }
    return by_name


def write_replica(entries: Mapping[str, dict], path: pathlib.Path) -> None:
    """A rank's replica into its own file of the checkpoint folder, straight from the tensors (torch.save
    writes each storage from memory: no staging copy, which would be 8 bytes per owned parameter; a slice
    that views a larger storage is copied, `compact`), each name's slices under the name, so a rank of
    another layout picks the names it owns."""
    torch.save(compact(dict(entries)), path)


def read_replica(paths: Iterable[pathlib.Path], names: Iterable[str]) -> dict[SliceKey, dict]:
    """The slices of `names` from the ranks' replica files (memory-mapped: only the names asked for are
    read), as copies the client may update in place."""
    wanted, slices = set(names), {}
    for path in paths:
        saved = torch.load(
            path, map_location="cpu", mmap=True, weights_only=False
        )  # our own file, checked by the manifest
        for name in wanted & saved.keys():
            for key, entry in saved[name].items():
                slices[key] = {
                    **entry,
                    "weights": entry["weights"].clone(),
                    "momentum": entry["momentum"].clone() if entry["momentum"] is not None else None,
                }
    return slices


def unpack_replica(packed: Mapping[str, bytes], names: Iterable[str]) -> dict[SliceKey, dict]:
    """The slices saved for `names` (an empty placeholder, or a name saved without any, adds none)."""
    slices: dict[SliceKey, dict] = {}
    for name in names:
        data = packed.get(name, b"")
        slices.update(unpack(data) if data else {})
    return slices


@dataclass(frozen=True)
class Installed:
    """What a restored replica gave the client: the version of each shard it holds, and the shards it
    could not give a whole copy of (their next pull is a full one), with why."""

    versions: dict[int, int]
    refused: dict[int, str]


def install_replica(
    restored: Mapping[SliceKey, dict],
    assignment: Iterable[ParamSlice],
    names: Iterable[str],
    held: MutableMapping[SliceKey, torch.Tensor],
    momentum: MutableMapping[SliceKey, torch.Tensor],
    versions: MutableMapping[int, int],
) -> Installed:
    """Put the restored slices of this rank's `names` into the client's replica, shard by shard: only a
    shard whose every slice of these names is there, with the assignment's shape and one version, counts
    as held (a replica with holes would replay onto nothing)."""
    owned = set(names)
    by_shard: dict[int, list[ParamSlice]] = {}
    for piece in assignment:
        if piece.name in owned:
            by_shard.setdefault(piece.shard, []).append(piece)
    installed: dict[int, int] = {}
    refused: dict[int, str] = {}
    for shard, pieces in sorted(by_shard.items()):
        entries = [restored.get(piece.key) for piece in pieces]
        if any(entry is None for entry in entries):
            refused[shard] = "the checkpoint holds no replica of some of its slices"
            continue
        shapes_ok = all(tuple(e["weights"].shape) == p.slice_shape for e, p in zip(entries, pieces))
        found = {e["version"] for e in entries}
        if not shapes_ok or len(found) != 1 or any(e["shard"] != shard for e in entries):
            refused[shard] = "the checkpoint's replica does not match the run's slices"
            continue
        for entry, piece in zip(entries, pieces):
            held[piece.key] = entry["weights"]
            if entry["momentum"] is not None:
                momentum[piece.key] = entry["momentum"]
        versions[shard] = installed[shard] = found.pop()
    return Installed(installed, refused)


def resume_summary(
    installed: Installed, kinds: Mapping[int, tuple[str, int, str]], bytes_down: int, params: int
) -> dict:
    """The `replica_resumed` log line: how the first pull after a resume came (delta: only the rounds
    missed, or none; full; mixed across shards), the bytes it took against a full pull's (weights and
    momentum in fp32, 8 bytes per parameter), and why any shard sent the weights in full."""
    hows = {kind for kind, _, _ in kinds.values()}
    how = "delta" if hows <= {"rounds", "current"} else "full" if hows == {"full"} else "mixed"
    reasons = sorted(
        {why for kind, _, why in kinds.values() if kind == "full" and why} | set(installed.refused.values())
    )
    return {
        "how": how,
        "bytes_down": bytes_down,
        "full_pull_bytes": 8 * params,
        "rounds_replayed": max((n for _, n, _ in kinds.values()), default=0),
        "from_versions": sorted(set(installed.versions.values())),
        "reason": "; ".join(reasons),
    }
