"""Shard checkpoints: everything a restarted shard needs to serve the same run from the same version.

Saved: the run's identity and model (digest, parameter list → the same assignment), membership, the
run's traffic counters, the published version with its global weights, the outer momentum, and the
contributions that made it (so clusters holding the previous version can still replay it). Not saved:
the open round's contributions — clusters re-push after a restart (pushes are idempotent, and the
client re-pushes while it waits).

Writes are atomic: a temporary file in the same folder, fsync, then rename; a crash mid-write leaves the
previous checkpoint intact. Every file carries a digest of its content, checked on load: a damaged file
is refused, and `--resume` falls back to the newest intact kept version (server/resume.py).
"""

from __future__ import annotations

import os
import pathlib
import time

import structlog

from dilocox.common.wire.checkpoint_format import (
    FORMAT_VERSION,
    checkpoint_path,
    key_tuple,
    load_state,
    loaded_payload,
    save_state,
    saved_payload,
    slice_key,
)
from dilocox.common.wire.framing import EncodedSlice
from dilocox.server.round_state import Contribution
from dilocox.server.shard import Shard
from dilocox.server.shard_records import Snapshot

log = structlog.get_logger()


def shard_state(shard: Shard) -> dict:
    """A plain, picklable description of the shard's durable state (call under the shard's lock);
    the layout is common/wire/checkpoint_format.py's."""
    snap = shard.snapshot
    key = key_tuple

    return {
        "format": FORMAT_VERSION,
        "run_id": shard.run_id,
        "shard_index": shard.shard_index,
        "num_shards": shard.num_shards,
        "digest": shard.digest,
        "param_specs": shard.param_specs,
        "run_config_json": shard.run_config_json,
        "tokenizer_digest": shard.tokenizer_digest,
        "tokenizer_json": shard.tokenizer_json,
        "members": dict(shard.members),
        "known": sorted(shard.known),
        "initialiser": shard.initialiser,
        # Run totals, so that a restarted shard's bytes_in/out (and their Prometheus counters) go on from
        # where they were; as of the checkpoint, so traffic after it and before a crash is not counted.
        "counters": {"bytes_in": shard.bytes_in, "bytes_out": shard.bytes_out, "dropped_bytes": shard.dropped_bytes},
        "outer": {"lr": shard.optimizer.lr, "momentum": shard.optimizer.momentum},
        "snapshot": None
        if snap is None
        else {
            "version": snap.version,
            "tensors": {key(k): t for k, t in snap.tensors.items()},
            "momentum": {key(k): t for k, t in snap.momentum.items()},
            "contributions": {
                key(k): {c: (x.weight, x.slice.codec, x.slice.dtype, x.slice.shape, saved_payload(x.slice.payload)) for c, x in per.items()}
                for k, per in snap.contributions.items()
            },
        },
    }


def save(shard: Shard, directory: str | os.PathLike) -> pathlib.Path:
    """Atomically write the shard's checkpoint, sealed with its digest; returns its path."""
    started = time.perf_counter()
    state = shard_state(shard)
    path = save_state(state, checkpoint_path(directory, shard.shard_index))
    version = state["snapshot"]["version"] if state["snapshot"] else -1
    log.info("checkpoint_saved", shard=shard.shard_index, version=version, path=str(path),
             seconds=round(time.perf_counter() - started, 3), bytes=path.stat().st_size)  # fmt: skip
    return path


def load(path: str | os.PathLike, expect: dict | None = None) -> dict:
    """The checkpoint's state, its digest checked (`CheckpointCorrupt`, `CheckpointError`: one line)."""
    return load_state(path, expect)


def restore(shard: Shard, state: dict) -> None:
    """Put a fresh shard back into the checkpointed state; refuses a checkpoint of another shard or run."""
    for field, want in (("run_id", shard.run_id), ("shard_index", shard.shard_index), ("num_shards", shard.num_shards)):
        if state[field] != want:
            raise ValueError(f"checkpoint is for {field}={state[field]!r}, this shard has {want!r}")
    shard.digest = state["digest"]
    shard.param_specs = [(n, tuple(s)) for n, s in state["param_specs"]]
    if shard.param_specs:
        shard.use_assignment(shard.param_specs)
    shard.run_config_json = state["run_config_json"]
    shard.tokenizer_digest = state.get("tokenizer_digest", "")  # checkpoints from before the field: recorded at the next join
    shard.tokenizer_json = state.get("tokenizer_json", "")
    shard.members = dict(state["members"])
    shard.last_seen = {cluster: time.monotonic() for cluster in shard.members}  # a restart counts as seen: the deadline runs anew
    shard.known = set(state.get("known", shard.members))  # checkpoints from before the field: the members
    shard.initialiser = state["initialiser"]
    counters = state.get("counters", {})  # checkpoints from before the field start at 0
    shard.bytes_in, shard.bytes_out = counters.get("bytes_in", 0), counters.get("bytes_out", 0)
    shard.dropped_bytes = counters.get("dropped_bytes", 0)
    shard.optimizer.lr = state["outer"]["lr"]
    shard.optimizer.momentum = state["outer"]["momentum"]
    snap = state["snapshot"]
    if snap is None:
        return
    tensors = {slice_key(k): t for k, t in snap["tensors"].items()}
    momentum = {slice_key(k): t for k, t in snap["momentum"].items()}
    contributions = {
        slice_key(k): {
            c: Contribution(c, w, EncodedSlice(slice_key(k), codec, dtype, tuple(shape), loaded_payload(payload)))
            for c, (w, codec, dtype, shape, payload) in per.items()
        }
        for k, per in snap["contributions"].items()
    }
    shard.snapshot = Snapshot(snap["version"], tensors, momentum, contributions)
    # Shared with the snapshot, as after any close: the next close updates them in place only when no
    # pull holds this version (a clone here cost one more copy of the momentum at every restore).
    shard.optimizer.buffers = dict(momentum)
    log.info("checkpoint_restored", shard=shard.shard_index, version=snap["version"], members=sorted(shard.members))


class Checkpointer:
    """Saves every `every` versions (as `Shard.on_publish`) and on demand (SIGTERM), keeping the last
    `keep` versions (`shard-<i>.pt` and `shard-<i>.v<version>.pt`), and never replaces a checkpoint by
    an older or emptier one: a restarted shard that somehow holds less than its folder keeps its hands off."""

    def __init__(self, shard: Shard, directory: str | os.PathLike, every: int = 1, keep: int = 3) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be ≥ 1 round, got {every}")
        if keep < 1:
            raise ValueError(f"checkpoints to keep must be ≥ 1, got {keep}")
        self.shard = shard
        self.directory = pathlib.Path(directory)
        self.every = every
        self.keep = keep
        self.written_version = shard.version if checkpoint_path(directory, shard.shard_index).exists() else None

    def __call__(self, snapshot: Snapshot) -> None:
        if snapshot.version % self.every == 0:
            self._write()

    def save_now(self) -> None:
        with self.shard._cond:
            self.shard.wait_until_published()  # a close stepping in place: its version is not whole yet
            self._write()

    def _write(self) -> None:
        version, index = self.shard.version, self.shard.shard_index
        if self.written_version is not None and version <= self.written_version:
            if version < self.written_version or self.shard.snapshot is None:
                log.warning("checkpoint_not_replaced", shard=index, version=version, kept_version=self.written_version,
                            reason="the checkpoint on disk is newer")  # fmt: skip
                return
        path = checkpoint_path(self.directory, index)
        if self.written_version is not None and self.written_version != version and path.exists() and self.keep > 1:
            os.replace(path, self.directory / f"shard-{index}.v{self.written_version}.pt")
            older = sorted(self.directory.glob(f"shard-{index}.v*.pt"), key=lambda p: int(p.stem.rsplit(".v", 1)[1]))
            for stale in older[: max(0, len(older) - (self.keep - 1))]:
                stale.unlink()
        save(self.shard, self.directory)
        self.written_version = version


def move_aside(directory: str | os.PathLike, shard_index: int) -> pathlib.Path:
    """`--fresh`: this shard's checkpoints (current, kept versions and refused ones) into a dated folder
    beside them."""
    folder = pathlib.Path(directory) / time.strftime(f"replaced-shard-{shard_index}-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=False)
    directory = pathlib.Path(directory)
    for file in [*directory.glob(f"shard-{shard_index}.*pt"), *directory.glob(f"shard-{shard_index}.*pt.refused-*")]:
        os.replace(file, folder / file.name)
    return folder
