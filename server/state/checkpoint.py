"""Shard checkpoints: everything a restarted shard needs to serve the same run from the same version.

Saved: the run's identity and model (digest, parameter list → the same assignment), membership, the
run's traffic counters, the published version with its global weights, the outer momentum, the
contributions that made it (so clusters holding the previous version can still replay it), and the rounds
chain up to it (server/state/provenance_chain.py; a file from before the chain restores to a new segment). Not saved:
the open round's contributions — clusters re-push after a restart (pushes are idempotent, and the
client re-pushes while it waits).

Writes are atomic: a temporary file in the same folder, fsync, then rename; a crash mid-write leaves the
previous checkpoint intact. Every file carries a digest of its content, checked on load: a damaged file
is refused, and `--resume` falls back to the newest intact kept version (server/state/resume.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable

import structlog

from dilocox.common.wire.checkpoint_format import (
    FORMAT_VERSION,
    checkpoint_path,
    key_tuple,
    load_state,
    one_line,
    save_state,
    slice_key,
)
from dilocox.server.shard import Shard
from dilocox.server.shard_records import Snapshot
from dilocox.server.state.contribution_state import contributions_from_state, contributions_state
from dilocox.server.state.provenance_chain import resume_chain

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
        # The rounds chain up to this version (server/state/provenance_chain.py): small, and covered by the
        # integrity digest.
        "rounds_chain": shard.chain.as_state(),
        # The update check's memory (server/checks/update_check.py): a restart must not release a quarantined site.
        "update_check": shard.update_check.as_state() if shard.update_check is not None else None,
        "snapshot": None
        if snap is None
        else {
            "version": snap.version,
            "tensors": {key(k): t for k, t in snap.tensors.items()},
            "momentum": {key(k): t for k, t in snap.momentum.items()},
            "contributions": contributions_state(snap.contributions),
        },
    }


def save(shard: Shard, directory: str | os.PathLike, sign: Callable[[dict], dict] | None = None) -> pathlib.Path:
    """Atomically write the shard's checkpoint, sealed with its digest (and signed by `sign`:
    server/state/checkpoint_signing.py); returns its path."""
    started = time.perf_counter()
    state = shard_state(shard)
    path = save_state(state, checkpoint_path(directory, shard.shard_index), sign)
    version = state["snapshot"]["version"] if state["snapshot"] else -1
    log.info(
        "checkpoint_saved",
        shard=shard.shard_index,
        version=version,
        path=str(path),
        signed=sign is not None,
        seconds=round(time.perf_counter() - started, 3),
        bytes=path.stat().st_size,
    )
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
    shard.tokenizer_digest = state.get(
        "tokenizer_digest", ""
    )  # checkpoints from before the field: recorded at the next join
    shard.tokenizer_json = state.get("tokenizer_json", "")
    shard.members = dict(state["members"])
    shard.last_seen = {
        cluster: time.monotonic() for cluster in shard.members
    }  # a restart counts as seen: the deadline runs anew
    shard.known = set(state.get("known", shard.members))  # checkpoints from before the field: the members
    shard.initialiser = state["initialiser"]
    counters = state.get("counters", {})  # checkpoints from before the field start at 0
    shard.bytes_in, shard.bytes_out = counters.get("bytes_in", 0), counters.get("bytes_out", 0)
    shard.dropped_bytes = counters.get("dropped_bytes", 0)
    if shard.update_check is not None and state.get("update_check"):  # older checkpoints: the check starts afresh
        shard.update_check.load_state(state["update_check"])
    shard.optimizer.lr = state["outer"]["lr"]
    shard.optimizer.momentum = state["outer"]["momentum"]
    snap = state["snapshot"]
    outer = (shard.optimizer.lr, shard.optimizer.momentum)
    if snap is None:
        shard.chain = resume_chain(
            state.get("rounds_chain"), shard.run_id, shard.shard_index, shard.num_shards, None, outer
        )
        return
    tensors = {slice_key(k): t for k, t in snap["tensors"].items()}
    momentum = {slice_key(k): t for k, t in snap["momentum"].items()}
    contributions = contributions_from_state(snap["contributions"])
    shard.snapshot = Snapshot(snap["version"], tensors, momentum, contributions)
    # Shared with the snapshot, as after any close: the next close updates them in place only when no
    # pull holds this version (a clone here cost one more copy of the momentum at every restore).
    shard.optimizer.buffers = dict(momentum)
    # Checked before it is trusted; a checkpoint from before the chain starts a new segment (said so in it).
    shard.chain = resume_chain(
        state.get("rounds_chain"), shard.run_id, shard.shard_index, shard.num_shards, shard.snapshot, outer
    )
    log.info("checkpoint_restored", shard=shard.shard_index, version=snap["version"], members=sorted(shard.members))


class Checkpointer:
    """Saves every `every` versions (as `Shard.on_publish`) and on demand (SIGTERM), keeping the last
    `keep` versions (`shard-<i>.pt` and `shard-<i>.v<version>.pt`), and never replaces a checkpoint by
    an older or emptier one: a restarted shard that somehow holds less than its folder keeps its hands off.

    A storage fault (ENOSPC, EIO, a read-only filesystem: torch reports some as RuntimeError) never fails a
    round: the version is published and its waiters woken whatever the disk says. The first failure of a
    streak is logged with the path, the reason and the space left; every failure is counted
    (`CheckpointHealth`: `dilocox status`, the metric `dilocox_checkpoint_failures_total`); the save is
    retried at the next version, interval or not, and a success ends the streak (`checkpoint_recovered`).
    The newest checkpoint is never removed before its successor is durable: the current file is kept under
    its version's name by a hard link (a copy where links are not supported), the new one replaces the
    name atomically, and only then are the oldest pruned. Temporary files a killed save left are removed
    at start."""

    def __init__(
        self,
        shard: Shard,
        directory: str | os.PathLike,
        every: int = 1,
        keep: int = 3,
        sign: Callable[[dict], dict] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be ≥ 1 round, got {every}")
        if keep < 1:
            raise ValueError(f"checkpoints to keep must be ≥ 1, got {keep}")
        self.shard = shard
        self.directory = pathlib.Path(directory)
        self.every = every
        self.keep = keep
        self.sign = sign  # `--checkpoint-sign-key`: every checkpoint signed (server/state/checkpoint_signing.py)
        self.written_version = shard.version if checkpoint_path(directory, shard.shard_index).exists() else None
        self.health = shard.checkpoint_health = CheckpointHealth()
        remove_temporary_files(self.directory, shard.shard_index)

    def __call__(self, snapshot: Snapshot) -> None:
        if snapshot.version % self.every == 0 or self.health.failing_since is not None:
            self._try_write()

    def save_now(self) -> bool:
        """Save the published version now (the stop's save); False when the storage refused it (logged)."""
        with self.shard._cond:
            self.shard.wait_until_published()  # a close stepping in place: its version is not whole yet
            return self._try_write()

    def _try_write(self) -> bool:
        version, path = self.shard.version, checkpoint_path(self.directory, self.shard.shard_index)
        try:
            self._write()
        except (OSError, RuntimeError) as error:
            reason = one_line(error)
            if self.health.failed(version, reason):
                log.error(
                    "checkpoint_failed",
                    shard=self.shard.shard_index,
                    version=version,
                    path=str(path),
                    reason=reason,
                    free_bytes=_free_bytes(self.directory),
                    kept_version=self.written_version,
                    effect="the round is published and served; the save is retried at every version until one succeeds",
                )
            return False  # the failed save's temporary file is gone already (common/atomic_file.py removes it)
        streak = self.health.succeeded()
        if streak:
            log.info("checkpoint_recovered", shard=self.shard.shard_index, version=version, failed_saves=streak)
        return True

    def _write(self) -> None:
        version, index = self.shard.version, self.shard.shard_index
        if self.written_version is not None and version <= self.written_version:
            if version < self.written_version or self.shard.snapshot is None:
                log.warning(
                    "checkpoint_not_replaced",
                    shard=index,
                    version=version,
                    kept_version=self.written_version,
                    reason="the checkpoint on disk is newer",
                )
                return
        path = checkpoint_path(self.directory, index)
        rotating = (
            self.written_version is not None and self.written_version != version and path.exists() and self.keep > 1
        )
        if rotating:  # the current file stays where it is until its successor is durable
            _keep_as(path, self.directory / f"shard-{index}.v{self.written_version}.pt")
        save(self.shard, self.directory, self.sign)
        self.written_version = version
        if rotating:
            older = sorted(self.directory.glob(f"shard-{index}.v*.pt"), key=lambda p: int(p.stem.rsplit(".v", 1)[1]))
            for stale in older[: max(0, len(older) - (self.keep - 1))]:
                stale.unlink()


class CheckpointHealth:
    """How the shard's saves are going: failures this run, and the current streak (what status, metrics
    and health report)."""

    def __init__(self) -> None:
        self.failures = 0
        self.failing_since: int | None = None  # the version whose save failed first in the current streak
        self.streak = 0
        self.last_error = ""

    def failed(self, version: int, reason: str) -> bool:
        """Count a failure; True when it starts a streak (the one to log)."""
        self.failures += 1
        self.streak += 1
        self.last_error = reason
        first = self.failing_since is None
        if first:
            self.failing_since = version
        return first

    def succeeded(self) -> int:
        """End a streak; returns how many saves it had failed (0: none)."""
        streak, self.streak, self.failing_since, self.last_error = self.streak, 0, None, ""
        return streak

    def as_status(self) -> dict:
        return {
            "checkpoint_failures": self.failures,
            "checkpoint_failing_rounds": self.streak,
            "checkpoint_error": self.last_error,
        }


def _keep_as(path: pathlib.Path, kept: pathlib.Path) -> None:
    """`kept` holds what `path` holds (a hard link: no bytes written; a copy where links are not supported)."""
    if kept.exists():  # an earlier attempt of this rotation got this far
        return
    try:
        os.link(path, kept)
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        # Copied under a temporary name first: a copy cut short by a full disk must never sit under the kept
        # name (its existence is what makes a retried rotation skip it); the name matches the start-up clean-up.
        fd, partial = tempfile.mkstemp(dir=kept.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        try:
            shutil.copy2(path, partial)
            os.replace(partial, kept)
        except BaseException:
            pathlib.Path(partial).unlink(missing_ok=True)
            raise


def remove_temporary_files(directory: pathlib.Path, shard_index: int) -> None:
    """Delete the temporary files of this shard's saves (`shard-<i>.pt<random>.tmp`): what a save killed
    mid-write, or one that failed, leaves behind."""
    removed = []
    for tmp in directory.glob(f"shard-{shard_index}.pt*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            size = tmp.stat().st_size
            tmp.unlink()
            removed.append((tmp.name, size))
    if removed:
        log.info(
            "checkpoint_temporary_removed",
            shard=shard_index,
            files=[n for n, _ in removed],
            bytes=sum(b for _, b in removed),
        )


def _free_bytes(directory: pathlib.Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def move_aside(directory: str | os.PathLike, shard_index: int) -> pathlib.Path:
    """`--fresh`: this shard's checkpoints (current, kept versions and refused ones) into a dated folder
    beside them."""
    folder = pathlib.Path(directory) / time.strftime(f"replaced-shard-{shard_index}-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=False)
    directory = pathlib.Path(directory)
    for file in [*directory.glob(f"shard-{shard_index}.*pt"), *directory.glob(f"shard-{shard_index}.*pt.refused-*")]:
        os.replace(file, folder / file.name)
    return folder
