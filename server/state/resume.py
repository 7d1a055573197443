"""`dilocox server --resume`: find the newest checkpoint of this shard that is intact, and fall back to an
older kept version when the newest is damaged.

Why falling back is safe: a shard restored from an older version is the case a kill -9 with
`--checkpoint-every` > 1 already makes, and the clusters handle it (docs/deploy.md, "A shard restored
from an older checkpoint"): one ahead of the shard gets `FAILED_PRECONDITION` on its next push, rejoins
at the shard's version, and the shard catches up within a few rounds. Serving a damaged file is not
safe: its weights are wrong with nothing to show for it, and the shard would save them again.

Only damage falls back (`CheckpointCorrupt`: unreadable, or content that does not match its digest).
Another run's or shard's file, or another format, is an operator's mix-up that an older file of the same
folder would not put right: that stops the shard with the reason.

A refused file is renamed aside (`shard-<i>.pt.refused-<date>`) and the intact one becomes `shard-<i>.pt`,
so the Checkpointer's rotation goes on from it and never renames the bad file into a kept slot. Every
step is a rename: a crash between them leaves the intact file under its kept name, where the next
`--resume` finds it again.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

import structlog

from dilocox.common.wire.checkpoint_format import (
    CheckpointCorrupt,
    CheckpointError,
    checkpoint_path,
    load_state,
    refused_path,
    shard_files,
    snapshot_version,
)

log = structlog.get_logger()
Refused = list[tuple[pathlib.Path, str]]  # damaged files with the reason, newest first
# Checks a loaded checkpoint beyond its digest (its signature: server/state/checkpoint_signing.py); raises a
# `CheckpointCorrupt` to refuse it like a damaged file.
Check = Callable[[pathlib.Path, dict], None]


def _newest_intact(
    files: list[pathlib.Path], expect: dict, check: Check | None = None
) -> tuple[pathlib.Path | None, dict | None, Refused]:
    """(the first file of `files` that loads — and passes `check`, e.g. its signature — its state, the
    damaged or refused ones before it with their reasons)."""
    refused: Refused = []
    for file in files:
        try:
            state = load_state(file, expect)
            if check is not None:
                check(file, state)
            return file, state, refused
        except CheckpointCorrupt as error:
            refused.append((file, str(error)))
    return None, None, refused


def describe_refusal(directory: str | os.PathLike, shard_index: int, expect: dict) -> str:
    """For a shard started without --resume over a damaged checkpoint: what --resume would use."""
    files = shard_files(directory).get(shard_index, [])
    try:
        used, state, refused = _newest_intact(files, expect)
    except CheckpointError as error:
        return f"a checkpoint it cannot use ({error})"
    reason = f"a damaged checkpoint ({refused[0][1]})" if refused else "a checkpoint"
    if used is None:
        return f"{reason}, and no intact kept version (--resume would stop too)"
    newest = f"the newest intact one is {used.name} (version {snapshot_version(state)})"
    return f"{reason}; {newest}, which --resume falls back to"


def load_for_resume(
    directory: str | os.PathLike, shard_index: int, expect: dict, check: Check | None = None
) -> tuple[pathlib.Path, dict]:
    """The newest intact checkpoint's path (now `shard-<i>.pt`) and state; damaged newer files are moved
    aside and the fallback logged (`checkpoint_fallback`). Raises `CheckpointError` (one line) when no
    intact one exists — then nothing is moved — or the newest readable file is not this shard's."""
    current = checkpoint_path(directory, shard_index)
    files = shard_files(directory).get(shard_index, [])
    if not files:
        raise CheckpointError(f"--resume: no checkpoint at {current}")
    used, state, refused = _newest_intact(files, expect, check)
    if used is None:
        listed = "; ".join(reason for _, reason in refused)
        raise CheckpointCorrupt(f"--resume: no intact checkpoint of shard {shard_index} in {directory}: {listed}")
    if used == current:
        return current, state
    moved = []
    for file, _ in refused:
        aside = refused_path(file)
        os.replace(file, aside)
        moved.append(str(aside))
    os.replace(used, current)  # the intact version becomes the newest: rotation goes on from it
    _fsync_folder(current.parent)
    first = refused[0] if refused else (current, f"{current} is missing")
    log.warning(
        "checkpoint_fallback",
        shard=shard_index,
        refused=str(first[0]),
        reason=first[1],
        used=str(used),
        version=snapshot_version(state),
        moved_to=moved,
        also_refused=[str(f) for f, _ in refused[1:]],
        note="an older version, as after a kill with --checkpoint-every > 1: clusters rejoin at it",
    )
    return current, state


def _fsync_folder(folder: pathlib.Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
