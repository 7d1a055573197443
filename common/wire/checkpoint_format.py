"""The shard checkpoint file: written by a shard (server/state/checkpoint.py), read back by a restarted shard,
and read offline by `dilocox export` to assemble the global model without a running service.

A file is one `torch.save`d dict per shard (`shard-<index>.pt`): the run's identity (`run_id`,
`shard_index`, `num_shards`), its model (`digest`, `param_specs` → the slice map every side derives the
same way), `run_config_json`, membership, and `snapshot`: the published `version`, its fp32 `tensors` and
outer `momentum` per slice keyed by (name, row_start, row_stop), and the contributions that made it.

Format 2 adds `integrity`, a SHA-256 over all of it (common/wire/checkpoint_integrity.py), checked on
every load: a damaged file is refused (`CheckpointCorrupt`) instead of resumed or exported. Format-1
files (written before the digest) still load, logged as unverified (docs/decisions.md, "How does a shard
checkpoint…").

Beside the newest `shard-<i>.pt` a shard keeps older versions as `shard-<i>.v<version>.pt`
(server/state/checkpoint.py); `shard_files` lists both, newest first, for a reader that falls back to an
intact older version. A refused file is renamed `shard-<i>.pt.refused-<date>`, a name no reader lists.
"""

from __future__ import annotations

import os
import pathlib
import re
import time
from collections.abc import Callable

import structlog
import torch

from dilocox.common.atomic_file import atomic_torch_save
from dilocox.common.wire import checkpoint_integrity as integrity
from dilocox.common.wire.framing import SliceKey

FORMAT_VERSION = 2
UNVERIFIED_FORMATS = (1,)  # readable, but written before the digest: nothing to check them against
_FILE_NAME = re.compile(r"^shard-(\d+)(?:\.v(\d+))?\.pt$")

log = structlog.get_logger()


class CheckpointError(ValueError):
    """A file that is not a checkpoint this shard (or export) can use: another format, run or shard."""


class CheckpointCorrupt(CheckpointError):
    """A damaged checkpoint: unreadable, or its content differs from its digest. An older intact
    version may stand in for it (the same as a restart after a kill with `--checkpoint-every` > 1)."""


def checkpoint_path(directory: str | os.PathLike, shard_index: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"shard-{shard_index}.pt"


def kept_path(directory: str | os.PathLike, shard_index: int, version: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"shard-{shard_index}.v{version}.pt"


def parse_name(path: str | os.PathLike) -> tuple[int, int | None] | None:
    """(shard index, kept version or None for the newest `shard-<i>.pt`), or None for another name."""
    match = _FILE_NAME.match(pathlib.Path(path).name)
    return None if match is None else (int(match.group(1)), None if match.group(2) is None else int(match.group(2)))


def shard_files(directory: str | os.PathLike) -> dict[int, list[pathlib.Path]]:
    """Every shard's checkpoint files in a folder, newest first: `shard-<i>.pt`, then the kept versions
    from the highest down."""
    found: dict[int, list[tuple[float, pathlib.Path]]] = {}
    for path in pathlib.Path(directory).iterdir() if pathlib.Path(directory).is_dir() else ():
        parsed = parse_name(path)
        if parsed is not None and path.is_file():
            found.setdefault(parsed[0], []).append((float("inf") if parsed[1] is None else parsed[1], path))
    return {
        index: [p for _, p in sorted(files, key=lambda f: f[0], reverse=True)] for index, files in sorted(found.items())
    }


def refused_path(path: pathlib.Path) -> pathlib.Path:
    """Where a refused file goes: beside it, under a name no reader or rotation lists."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = path.with_name(f"{path.name}.refused-{stamp}"), 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}.refused-{stamp}-{n}"), n + 1
    return candidate


def snapshot_version(state: dict) -> int:
    return state["snapshot"]["version"] if state.get("snapshot") else -1


def key_tuple(key: SliceKey) -> tuple:
    return (key.name, key.row_start, key.row_stop)


def slice_key(item: tuple) -> SliceKey:
    return SliceKey(*item)


def saved_payload(payload: bytes | bytearray) -> torch.Tensor:
    """A contribution's payload as torch.save should hold it: a uint8 tensor over the same memory, which
    torch writes straight to the file. A `bytearray` goes through pickle instead, whole, into memory:
    saving 2.3 GB of fp32 state took 18 s and peaked at 3.9× the state."""
    buffer = payload if isinstance(payload, bytearray) else bytearray(payload)
    return torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.empty(0, dtype=torch.uint8)


def loaded_payload(saved: torch.Tensor | bytes | bytearray) -> bytearray:
    """The payload back from a checkpoint (files written before `saved_payload` hold bytes)."""
    return bytearray(saved.numpy()) if isinstance(saved, torch.Tensor) else bytearray(saved)


def save_state(state: dict, path: str | os.PathLike, sign: Callable[[dict], dict] | None = None) -> pathlib.Path:
    """Seal the state with its digest (then, with `sign`, add a signature over it: server/state/checkpoint_signing.py)
    and write it atomically; returns the path."""
    sealed = integrity.seal(state)
    return atomic_torch_save(sign(sealed) if sign is not None else sealed, path)


def one_line(error: BaseException) -> str:
    """An exception as one short line: its type and the first sentence of its message."""
    text = (str(error).strip().splitlines() or [""])[0]
    if len(text) > 120 and ". " in text:  # torch's zip errors go on for three sentences
        text = text[: text.index(". ") + 1]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def load_state(path: str | os.PathLike, expect: dict | None = None) -> dict:
    """A checkpoint's dict, its digest checked. Raises `CheckpointCorrupt` for a file that cannot be
    read or whose content is not what was saved, `CheckpointError` for another format, or another run's
    or shard's file (`expect`: field → value, e.g. run_id, shard_index, num_shards); the message is one
    line that starts with the path."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # a dilocox file, written by a shard
    except Exception as error:  # noqa: BLE001 - whatever a damaged zip or pickle raises, it is one refusal
        raise CheckpointCorrupt(f"{path}: unreadable ({one_line(error)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a shard checkpoint (holds a {type(state).__name__})")
    found = state.get("format")
    if integrity.FIELD in state or found == FORMAT_VERSION:  # a sealed file, or one whose seal was damaged
        try:
            problem = integrity.check(state)
        except TypeError as error:  # a value no shard writes: the pickle was altered
            problem = str(error)
        if problem is not None:
            raise CheckpointCorrupt(f"{path}: damaged: {problem}")
    if found != FORMAT_VERSION and found not in UNVERIFIED_FORMATS:
        raise CheckpointError(
            f"{path}: checkpoint format {found!r}, this build reads {[*UNVERIFIED_FORMATS, FORMAT_VERSION]}"
        )
    if found in UNVERIFIED_FORMATS:
        log.warning(
            "checkpoint_unverified",
            path=str(path),
            format=found,
            reason="written before checkpoints carried a digest: it cannot be checked",
        )
    for field, want in (expect or {}).items():
        if state.get(field) != want:
            raise CheckpointError(f"{path}: checkpoint is for {field}={state.get(field)!r}, this shard has {want!r}")
    return state


def verified(state: dict) -> bool:
    """Whether the state was checked against a digest when loaded (format 2), not taken on trust."""
    return integrity.FIELD in state
