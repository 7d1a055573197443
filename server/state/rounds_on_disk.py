"""The rounds a shard keeps on its disk, for a day by default, so that a site back after a Slurm requeue, a
Kubernetes reschedule or a night away resumes by delta instead of pulling the whole model.

A restarted site holds the replica of the version its checkpoint saved; it needs every version's
contributions since (server/rounds/recent_rounds.py keeps the newest `--keep-rounds` in memory). Missing one
more round than that used to cost the whole model over the WAN: 565 GB at 70B, about 75 minutes at
1 Gbit/s, for a site that missed five rounds. A round's compressed contributions are small (84 MB a site
at 107B), so keeping each published version's on disk for `--keep-rounds-s` (default a day) turns every
ordinary restart into a delta, bounded by `--keep-rounds-disk-gb`: past it the oldest go first, and the
shard says once how far back it then reaches.

One file a version (`<dir>/shard-<i>/v<version>.pt`), sealed with its digest and written atomically, as
checkpoints are, by a thread of its own: the round's close never waits for the disk; read back with
torch's weights-only loader, so a changed file can be refused but never run. A file that cannot
be read or belongs to another run is never served (the site pulls in full); a write the disk refuses is
logged and skipped, and the versions before it are no longer a chain, so a site that far behind pulls in
full. On a restart the shard keeps the files up to the version it resumed from (the same run's rounds)
and deletes the rest; a shard started afresh deletes them all: another run's round v is not this one's.
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable

import structlog

from dilocox.common.wire import checkpoint_integrity as integrity
from dilocox.common.wire.checkpoint_format import CheckpointError, one_line, save_state
from dilocox.server.state.contribution_state import Contributions, contributions_from_state, contributions_state

log = structlog.get_logger()

DEFAULT_KEEP_ROUNDS_S = 86_400.0
DEFAULT_KEEP_ROUNDS_DISK_GB = 50.0
FORMAT = 1
_NAME = re.compile(r"^v(\d+)\.pt$")


class RoundsOnDisk:
    def __init__(
        self,
        directory: str | os.PathLike,
        shard_index: int,
        run_id: str,
        keep_s: float = DEFAULT_KEEP_ROUNDS_S,
        budget_bytes: int = int(DEFAULT_KEEP_ROUNDS_DISK_GB * 1e9),
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not keep_s > 0:
            raise ValueError(f"--keep-rounds-s must be positive to keep rounds on disk, got {keep_s}")
        if budget_bytes < 1:
            raise ValueError(f"--keep-rounds-disk-gb must be positive, got {budget_bytes / 1e9:g}")
        self.folder = pathlib.Path(directory) / f"shard-{shard_index}"
        self.shard_index, self.run_id = shard_index, run_id
        self.keep_s, self.budget_bytes, self.clock = keep_s, budget_bytes, clock
        self._files: dict[int, tuple[int, float]] = {}  # version -> (bytes, saved at: wall clock)
        self._pending: dict[int, Contributions] = {}  # queued, not yet on disk: served from here meanwhile
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[int, Contributions] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._budget_said = False  # said once: the budget, not the age, decides what goes
        self.write_failures = 0

    # ------------------------------------------------------------------ start and stop
    def open(self, resumed_version: int | None) -> None:
        """Take up the folder: keep the files of versions ≤ `resumed_version` (this run's, restored from a
        checkpoint), delete the rest (all of them when the run starts afresh: None), then start the writer."""
        self.folder.mkdir(parents=True, exist_ok=True)
        dropped = 0
        for path in self.folder.iterdir():
            match = _NAME.match(path.name)
            version = int(match.group(1)) if match else None
            if version is None or resumed_version is None or version > resumed_version:
                dropped += 1
                _unlink(path)  # a crash's temporary file, a newer version the restart will make anew, another run's
                continue
            stat = path.stat()
            self._files[version] = (stat.st_size, stat.st_mtime)
        self._prune()
        free = shutil.disk_usage(self.folder).free
        log.info(
            "recent_rounds_on_disk",
            shard=self.shard_index,
            dir=str(self.folder),
            keep_s=self.keep_s,
            budget_bytes=self.budget_bytes,
            free_bytes=free,
            versions_kept=len(self._files),
            deleted=dropped,
            oldest=min(self._files, default=None),
        )
        if free < self.budget_bytes:
            log.warning(
                "recent_rounds_budget_over_free_space",
                shard=self.shard_index,
                budget_bytes=self.budget_bytes,
                free_bytes=free,
                effect="a write the disk refuses is skipped, and sites further behind than the rounds kept pull "
                "in full",
            )
        self._writer = threading.Thread(target=self._write_loop, name=f"rounds-on-disk-{self.shard_index}", daemon=True)
        self._writer.start()

    def flush(self) -> None:
        """Wait until every version put so far is written (or its write failed)."""
        self._queue.join()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (bounded), then stop the writer."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout_s)
            self._writer = None

    # ------------------------------------------------------------------ the rounds
    def put(self, version: int, contributions: Contributions) -> None:
        """Keep `version`'s contributions (written by the writer thread; served from memory until then)."""
        if not contributions:
            return  # the initial weights, or a version restored without its contributions: nothing to replay
        with self._lock:
            self._pending[version] = contributions
        self._queue.put((version, contributions))

    def get(self, version: int) -> Contributions | None:
        """`version`'s contributions, or None when they are not kept (or their file cannot be trusted)."""
        with self._lock:
            if version in self._pending:
                return self._pending[version]
            if version not in self._files:
                return None
        path = self._path(version)
        try:
            return contributions_from_state(self._load(path, version)["contributions"])
        except Exception as error:  # noqa: BLE001 - whatever a damaged zip or pickle raises, the round is not served
            log.warning(
                "recent_round_unreadable",
                shard=self.shard_index,
                version=version,
                path=str(path),
                error=one_line(error),
                effect="not served: a site that needs it pulls the weights in full",
            )
            with self._lock:
                self._files.pop(version, None)
            _unlink(path)
            return None

    def versions(self) -> set[int]:
        with self._lock:
            return set(self._files) | set(self._pending)

    def bytes_on_disk(self) -> int:
        with self._lock:
            return sum(size for size, _ in self._files.values())

    def oldest_saved_at(self) -> float | None:
        with self._lock:
            return min((saved for _, saved in self._files.values()), default=None)

    def _load(self, path: pathlib.Path, version: int) -> dict:
        """A kept round's state, read without running any code a changed file could hold (torch's
        weights-only loader: these files are plain tables of tensors), its digest and identity checked."""
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: not a kept round (holds a {type(state).__name__})")
        problem = integrity.check(state)
        if problem is not None:
            raise CheckpointError(f"{path}: damaged: {problem}")
        for field, want in (
            ("format", FORMAT),
            ("run_id", self.run_id),
            ("shard_index", self.shard_index),
            ("version", version),
        ):
            if state.get(field) != want:
                raise CheckpointError(f"{path}: {field} is {state.get(field)!r}, not {want!r}")
        return state

    # ------------------------------------------------------------------ the writer
    def _path(self, version: int) -> pathlib.Path:
        return self.folder / f"v{version}.pt"

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, version: int, contributions: Contributions) -> None:
        try:
            state = {
                "format": FORMAT,
                "run_id": self.run_id,
                "shard_index": self.shard_index,
                "version": version,
                "contributions": contributions_state(contributions),
            }
            path = save_state(state, self._path(version))
            with self._lock:
                self._files[version] = (path.stat().st_size, self.clock())
        except Exception as error:  # noqa: BLE001 - a disk fault never fails a round; the chain just ends here
            self.write_failures += 1
            log.warning(
                "recent_round_not_kept",
                shard=self.shard_index,
                version=version,
                error=one_line(error),
                effect="sites further behind than this version pull the weights in full",
            )
            with self._lock:  # the versions before it are no longer a chain a site could replay through
                older = [v for v in self._files if v < version]
                for v in older:
                    self._files.pop(v)
            for v in older:
                _unlink(self._path(v))
        finally:
            with self._lock:
                self._pending.pop(version, None)
        self._prune()

    def _prune(self) -> None:
        """Drop versions older than `keep_s`, then the oldest while over the budget: always from the oldest
        end, so what is kept stays a chain up to the newest."""
        now = self.clock()
        with self._lock:
            ordered = sorted(self._files)
            total = sum(size for size, _ in self._files.values())
            gone, by_budget = [], 0
            for version in ordered:
                size, saved_at = self._files[version]
                if now - saved_at > self.keep_s:
                    gone.append(version)
                elif total > self.budget_bytes and version != ordered[-1]:
                    gone.append(version)
                    by_budget += 1
                else:
                    break
                total -= size
            for version in gone:
                self._files.pop(version)
            reach_s = now - min((saved for _, saved in self._files.values()), default=now)
        for version in gone:
            _unlink(self._path(version))
        if by_budget and not self._budget_said:
            self._budget_said = True
            log.warning(
                "recent_rounds_budget_reached",
                shard=self.shard_index,
                budget_bytes=self.budget_bytes,
                reaches_back_s=round(reach_s),
                keep_s=self.keep_s,
                effect="the oldest rounds go before --keep-rounds-s: a site away longer than reaches_back_s pulls in "
                "full; "
                "raise --keep-rounds-disk-gb to keep the whole window",
            )


def _unlink(path: pathlib.Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        log.warning("recent_round_not_deleted", path=str(path), error=one_line(error))
