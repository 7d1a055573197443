"""Which shard checkpoint files an offline `dilocox export` reads.

A shard's checkpoint folder holds its newest `shard-<i>.pt` and the versions kept before it
(`shard-<i>.v<N>.pt`). The export needs one version on every shard, every file intact (its digest
checked on load): the newest such version is used, and a damaged newer file is skipped and said so,
not exported. Explicit file paths are taken as given, one per shard.

Errors are `CheckpointError`s with the message the user sees; `worker/export/model.py` turns them into its
`ExportError`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterable

from dilocox.common.wire.checkpoint_format import (
    CheckpointCorrupt,
    CheckpointError,
    load_state,
    parse_name,
    shard_files,
    snapshot_version,
)

Chosen = dict[int, tuple[pathlib.Path, dict]]  # shard index → (file, its state)


def load_weights(file: pathlib.Path) -> dict:
    """A shard checkpoint, its digest checked, keeping of its snapshot only the weights (the momentum and
    the contributions are half or more of the file, and an export never reads them)."""
    state = load_state(file)
    snap = state.get("snapshot")
    if snap is not None:
        state["snapshot"] = {"version": snap["version"], "tensors": snap["tensors"]}
    return state


def gather(locations: Iterable[str | pathlib.Path]) -> tuple[Chosen, dict[int, list[pathlib.Path]]]:
    """(explicit files, read: shard → (file, state); folders' files, unread: shard → files newest first).
    A shard offered twice (two files, two folders, a file and a folder) is refused."""
    explicit: Chosen = {}
    offered: dict[int, list[pathlib.Path]] = {}
    for location in map(pathlib.Path, locations):
        state = None
        if location.is_dir():
            found = shard_files(location)
        elif location.is_file():
            try:  # an explicit file must be intact: there is no other to use
                state = load_weights(location)
            except CheckpointError as error:
                raise type(error)(f"not a usable shard checkpoint: {error}") from None
            found = {state["shard_index"]: [location]}
        else:
            found = {}
        if not found:
            raise CheckpointError(f"no shard checkpoint at {location} (expected shard-<index>.pt files)")
        for index, files in found.items():
            if index in explicit or index in offered:
                other = explicit[index][0] if index in explicit else offered[index][0].parent
                raise CheckpointError(f"two checkpoints of shard {index} ({files[0]} and {other}): give one per shard")
            if state is None:
                offered[index] = files
            else:
                explicit[index] = (location, state)
    return explicit, offered


def pick_versions(explicit: Chosen, offered: dict[int, list[pathlib.Path]], report: Callable[[str], None]) -> Chosen:
    """Per shard, the file of the newest version every shard has intact. A folder's `shard-<i>.pt` is read
    first (its version is in the file), a kept `shard-<i>.v<N>.pt` only when version N is wanted; the
    wanted version only goes down, so each file is read at most once and one state per shard is held.
    With every file intact but no version in common, each shard's newest is returned: the assembly then
    names the versions that differ."""
    versions: dict[int, dict[int, pathlib.Path]] = {i: {snapshot_version(st): f} for i, (f, st) in explicit.items()}
    held = dict(explicit)
    damaged: dict[int, list[str]] = {}

    def read(index: int, file: pathlib.Path) -> dict | None:
        try:
            return load_weights(file)
        except CheckpointCorrupt as error:
            damaged.setdefault(index, []).append(str(error))
            report(f"shard {index}: skipped {error}")
            return None

    for index, files in offered.items():
        versions[index] = {}
        for file in files:
            kept = parse_name(file)[1]
            if kept is not None:
                versions[index].setdefault(kept, file)
            elif (state := read(index, file)) is not None:
                held[index] = (file, state)
                versions[index].setdefault(snapshot_version(state), file)
    while True:
        for index in sorted(versions):
            if not versions[index]:
                raise CheckpointCorrupt(f"shard {index}: no intact checkpoint: " + "; ".join(damaged.get(index, [])))
        common = set.intersection(*(set(v) for v in versions.values()))
        if not common:
            if not damaged:
                return {i: held[i] if i in held else (v[max(v)], load_weights(v[max(v)])) for i, v in versions.items()}
            listed = "; ".join(f"shard {i}: {sorted(v, reverse=True)}" for i, v in sorted(versions.items()))
            skipped = "; ".join(reason for reasons in damaged.values() for reason in reasons)
            raise CheckpointCorrupt(
                f"no version that every shard has intact (intact or unread: {listed}); damaged: {skipped}"
            )
        target = max(common)
        for index in sorted(versions):
            file = versions[index][target]
            if index in held and held[index][0] == file:
                continue
            held.pop(index, None)  # a newer version of this shard is no longer wanted
            state = read(index, file)
            if state is not None and snapshot_version(state) != target:
                damaged.setdefault(index, []).append(
                    f"{file}: named version {target} but holds {snapshot_version(state)}"
                )
                report(f"shard {index}: skipped {damaged[index][-1]}")
                state = None
            if state is None:
                del versions[index][target]
                break
            held[index] = (file, state)
        else:
            return {i: held[i] for i in sorted(versions)}
