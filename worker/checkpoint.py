"""A cluster's local state on disk, by `torch.distributed.checkpoint` (DCP), so a run can be stopped and
resumed: one checkpoint per round for the whole site, each rank writing its own part of it once.

What a checkpoint of round t holds, captured at the end of round t, before its pseudo-gradient leaves:

* ``model``, ``optim`` — the stage's weights and AdamW state as DCP sees them through
  `get_model_state_dict` / `get_optimizer_state_dict`: FSDP2's DTensors, so each rank writes its shard
  and replicas (HSDP, plain replication, or pipeline stages' shared objects) are written once;
* ``progress`` — inner step and tokens trained (the same on every rank);
* ``data.replica<d>`` — replica d's batch sampler (the same on every stage of that replica's pipeline);
* ``exchange.<name>`` — the uplink compressor's state (error-feedback residual, warm-start Q, rank
  history) of each parameter, written by the rank that owns it;
* ``replica-rank<r>.pt`` (beside DCP's files) — each rank's replica of the global model for the
  parameters it exchanges (weights, outer momentum, each shard's version: `worker/exchange/replica_state.py`),
  written from the live tensors by a thread while the pull's fold waits (no staging copy), so that
  `--resume` pulls only the rounds since, which the shards keep (`dilocox server --keep-rounds`), not
  the whole model. Keyed by parameter name: another layout's ranks pick theirs from every rank's file.

The save is DCP's `async_save`: the state is staged to host memory at the boundary (no copy on the
device) and written by a background thread over the site's own gloo group, while training goes on. The
staging buffers are kept and refilled at the next checkpoint (DCP's `DefaultStager` cache), pinned on a
GPU by registering them (no rounding up to a power of two, no new pinned allocation per checkpoint).
`checkpoint_staging = "sync"` stages nothing: DCP's `save` writes from the live state, a piece at a time,
while the site waits (worker/checkpoint_staging.py). The
checkpoint is *committed* — a `COMMITTED` file next to DCP's `.metadata` — only once round t's
pseudo-gradient is on the shards (one round later under the delay), so a resume never starts from a
round the shards have not got. `--resume` takes the newest committed one; older ones are pruned.

`COMMITTED` carries the checkpoint's integrity: a JSON manifest of every file's size, written by rank 0
once every rank's part is on disk, and every rank's seal of the SHA-256 of what it wrote, hashed in a
thread of its own (worker/checkpoint_manifest.py: the ranks hash in parallel, none re-reads the whole
checkpoint, and pruning never waits for a hash). `--resume` checks them before loading; a damaged newest checkpoint is
moved
aside (`round-NNNNNN.refused-<date>`) and the next intact committed one is used, with a warning — where the
site would be had it been stopped a round or two earlier: the shards tell it which round to train. A
`COMMITTED` from before the manifest (the round number) is taken as unverified; an empty one is no commit
(what a crash leaves of an unsynced marker): the marker is fsynced before its rename and the folder after.

A resume with the same layout restores every rank's state bit for bit. With another layout (other
--pp, --dp or --dp-replicate), DCP reshards the weights and optimiser state, and the compressor state
follows its parameters to their new owners (it is keyed by parameter, not by rank); only the data
position is lost where the number of replicas changed (each replica's sampler is keyed by replica),
which is logged. The directory must be shared by every rank of the site (one node, or a shared file
system across nodes), as DCP requires.

This module saves and commits; reading a checkpoint back (`restore`, the choice of the one it loads, and
`read_progress`) is worker/checkpoint_restore.py, mixed into `SiteCheckpoint`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from dilocox.common.atomic_file import write_text_atomic
from dilocox.common.wire.compression import TensorCompressor
from dilocox.worker.checkpoint_manifest import COMMITTED, REPLICA_FILE_PREFIX, commit_record, seal
from dilocox.worker.checkpoint_restore import OPTIM_OPTIONS, ROUND_DIR, CheckpointRestore
from dilocox.worker.checkpoint_staging import (
    SAVE_ERRORS,
    first_line,
    reusable_stager,
    settled,
    tensor_bytes,
    written_once,
)
from dilocox.worker.exchange.packed_state import compressor_state_by_name, pack
from dilocox.worker.exchange.replica_state import write_replica
from dilocox.worker.train.light_adamw import optimizer_state_of

log = structlog.get_logger()

SEAL_WAIT_S = 600.0  # how long a rank's sealer waits for rank 0's COMMITTED of the round it seals


class SiteCheckpoint(CheckpointRestore):
    def __init__(
        self,
        directory: str | os.PathLike,
        cluster: str,
        every: int = 1,
        keep: int = 2,
        rank: int = 0,
        replica: int = 0,
        group: dist.ProcessGroup | None = None,
        staging: str = "async",
        pinned: bool = False,
        every_s: float = 0.0,
        agreement_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`rank`: this process's rank in the site (rank 0 commits and prunes); `replica`: which data
        replica it trains; `group`: the site's checkpoint group (None: one process, no collectives).
        `staging`: "async" (staged into kept host buffers, `pinned` where a GPU copies into them, written in
        the background) or "sync" (written from the live state while the site waits). `every_s` > 0: a
        checkpoint at the first round boundary at least that long after the last one, instead of every
        `every` rounds — for rounds much shorter than a checkpoint's write; the ranks agree on it over
        `agreement_group` (their clocks differ by a little)."""
        if every_s < 0:
            raise ValueError(f"checkpoint interval must be ≥ 0 s, got {every_s}")
        if staging not in ("async", "sync"):
            raise ValueError(f"checkpoint staging must be async or sync, got {staging!r}")
        if every < 1:
            raise ValueError(f"checkpoint interval must be ≥ 1 round, got {every}")
        if keep < 1:
            raise ValueError(f"checkpoints kept must be ≥ 1, got {keep}")
        self.root = pathlib.Path(directory) / cluster
        self.every = every
        self.keep = keep
        self.rank = rank
        self.replica = replica
        self.group = group
        self._pending: dict[int, Future] = {}
        self._sealer: ThreadPoolExecutor | None = None  # each rank: hashes its part off the training thread
        self._sealing: list[Future] = []
        self._writer: ThreadPoolExecutor | None = None  # each rank: its replica file, beside DCP's
        self._replicas: dict[int, Future] = {}
        self.staged_bytes = 0  # the last capture's tensors, as this rank staged them
        self.staging = staging
        self.pinned = pinned
        self._stager = None  # DCP's DefaultStager, kept: its staged buffers are reused at every checkpoint
        self.every_s = every_s
        self.agreement_group = agreement_group
        self._last_capture = time.monotonic()

    def path_of(self, round_: int) -> pathlib.Path:
        return self.root / f"round-{round_:06d}"

    # ------------------------------------------------------------------ save
    def _state(self, trainer, compressor: TensorCompressor | None, names: list[str]) -> dict:  # noqa: ANN001
        module, optimizer = trainer.trained_module, trainer.optimizer
        exchange = compressor_state_by_name(compressor, names)
        return {
            "model": written_once(get_model_state_dict(module)),
            "optim": written_once(get_optimizer_state_dict(module, optimizer, options=OPTIM_OPTIONS)),
            "progress": {
                "step": int(trainer.step),
                "tokens_seen": int(trainer.tokens_seen),
                "optimizer_state": optimizer_state_of(optimizer),
                "eval_best": float(getattr(trainer, "eval_best", math.inf)),
            },  # the loss watch's best
            "data": {f"replica{self.replica}": pack(trainer.sampler.state_dict())},
            "exchange": exchange,
        }

    def capture(
        self,
        round_: int,
        trainer,
        compressor: TensorCompressor | None,
        names: list[str],  # noqa: ANN001
        always: bool = False,
        client=None,
    ) -> None:  # noqa: ANN001
        """Start saving the state round `round_` ends with (every `every` rounds, or `always`: the end-of-run
        flush's, which a run extended later resumes from); collective in a site. Returns once the state
        is staged in host memory; the write goes on in the background. `client`: its replica of the
        global model is written too, beside DCP's files (`_write_replica`), so a resume pulls only the
        rounds since."""
        if not always and not self._due(round_):
            return
        self._last_capture = time.monotonic()
        self._wait_all()  # one write at a time: the previous one is finished before this one stages
        path = self.path_of(round_)
        if self.rank == 0 and path.exists():
            shutil.rmtree(path)  # a stale partial write of this round (an earlier, interrupted run)
        if self.group is not None:
            dist.barrier(group=self.group)
        state = self._state(trainer, compressor, names)
        started = time.perf_counter()
        try:
            if self.staging == "sync":  # from the live state, while the site waits: nothing staged
                dcp.save(state, checkpoint_id=str(path), process_group=self.group, no_dist=self.group is None)
                self._pending[round_] = done = Future()
                done.set_result(None)
            else:
                self._stager = self._stager or reusable_stager(self.pinned)
                self._pending[round_] = dcp.async_save(
                    state,
                    checkpoint_id=str(path),
                    process_group=self.group,
                    no_dist=self.group is None,
                    async_stager=self._stager,
                )
        except SAVE_ERRORS as error:  # DCP's planning is collective: every rank of the site is here
            self._failed(round_, error)
            return
        if client is not None:  # beside DCP's files, from the live replica: the pull's fold waits meanwhile
            self._writer = self._writer or ThreadPoolExecutor(1, thread_name_prefix="checkpoint-replica")
            self._replicas[round_] = self._writer.submit(self._write_replica, path, client, list(names))
        self.staged_bytes = tensor_bytes(state) if self.staging == "async" else 0
        log.info(
            "worker_checkpoint_staged",
            round=round_,
            path=str(path),
            staging=self.staging,
            staged_bytes=self.staged_bytes,
            seconds=round(time.perf_counter() - started, 3),
        )

    def _due(self, round_: int) -> bool:
        """Whether round `round_`'s boundary takes a checkpoint: every `every` rounds, or with `every_s`
        once that long has passed — agreed over the site (any rank's clock past it: all)."""
        if self.every_s <= 0:
            return round_ % self.every == 0
        due = torch.tensor([int(time.monotonic() - self._last_capture >= self.every_s)])
        if self.agreement_group is not None:
            dist.all_reduce(due, op=dist.ReduceOp.MAX, group=self.agreement_group)
        return bool(due.item())

    def _write_replica(self, path: pathlib.Path, client, names: list[str]) -> None:  # noqa: ANN001
        path.mkdir(parents=True, exist_ok=True)
        with client.replica_lock:
            write_replica(client.replica_entries(names), path / f"{REPLICA_FILE_PREFIX}{self.rank:05d}.pt")

    def commit(self, round_: int) -> None:
        """Round `round_` is on the shards: its checkpoint (if one was started) becomes the one to resume."""
        future, replica = self._pending.pop(round_, None), self._replicas.pop(round_, None)
        for older in [r for r in self._pending if r < round_]:
            self._pending.pop(older).result()  # superseded; let it finish, it stays uncommitted
            superseded = self._replicas.pop(older, None)
            if superseded is not None:
                superseded.result()
        if future is None:
            return
        try:
            future.result()  # on rank 0: every rank's part and DCP's metadata are written
        except SAVE_ERRORS as error:  # DCP gathers every rank's failure and raises it on all of them
            if replica is not None:
                settled(replica)
            self._failed(round_, error)
            return
        if replica is not None:
            replica_error = settled(replica)
            if replica_error is not None:  # the rest is intact: a resume from it pulls the weights in full
                log.warning("worker_checkpoint_replica_failed", round=round_, error=replica_error)
            if self.group is not None:  # every rank's replica file is in before rank 0 hashes the folder (DCP's
                dist.barrier(group=self.group)  # collectives on this group are over: each rank's save returned)
        # Rank 0 commits the folder's listing now and prunes, never behind a hash; each rank then hashes
        # what it wrote, in a thread of its own, once the listing is there (worker/checkpoint_manifest.py).
        if self.rank == 0:
            self._commit_listing(round_)
        self._sealer = self._sealer or ThreadPoolExecutor(1, thread_name_prefix="checkpoint-seal")
        self._sealing.append(self._sealer.submit(self._seal, round_))

    def _failed(self, round_: int, error: BaseException) -> None:
        """A save the storage refused (full disk, I/O error, read-only folder): the site trains on and a
        resume takes the newest committed checkpoint. Rank 0 removes what was written of this one once
        every rank is past it."""
        path = self.path_of(round_)
        log.error(
            "worker_checkpoint_failed",
            round=round_,
            path=str(path),
            error=first_line(error),
            effect="training goes on; this round is not saved, a resume takes the newest committed checkpoint",
        )
        if self.group is not None:
            dist.barrier(group=self.group)
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def _commit_listing(self, round_: int) -> None:
        """Rank 0: `COMMITTED` — the folder's files by size and the seals to come — written durably, then
        the prune. A listing, not a read: it takes no longer for a terabyte than for a megabyte."""
        path = self.path_of(round_)
        ranks = dist.get_world_size(self.group) if self.group is not None else 1
        try:
            record = commit_record(path, round_, ranks)
            write_text_atomic(path / COMMITTED, json.dumps(record, indent=1) + "\n", durable=True)
            self._prune(round_)
        except OSError as error:  # uncommitted, so no resume would take it: its space is given back
            log.error(
                "worker_checkpoint_commit_failed",
                round=round_,
                path=str(path),
                error=first_line(error),
                effect="training goes on; this round is not saved, a resume takes the newest committed checkpoint",
            )
            shutil.rmtree(path, ignore_errors=True)
            return
        log.info(
            "worker_checkpoint_saved",
            round=round_,
            path=str(path),
            files=len(record["files"]),
            bytes=sum(f["bytes"] for f in record["files"].values()),
        )

    def _seal(self, round_: int) -> None:
        """Every rank, in the sealer thread: hash the files it wrote into its seal, once rank 0's `COMMITTED`
        is there — never into a folder whose commit failed (rank 0 removes it: a seal written meanwhile would
        leave a folder that is neither committed nor gone). A failure leaves that part checked by size only
        at a resume (said then), never the run stopped."""
        started = time.perf_counter()
        path = self.path_of(round_)
        deadline = time.monotonic() + SEAL_WAIT_S
        while not (path / COMMITTED).exists():
            if not path.is_dir() or time.monotonic() > deadline:  # the commit failed, or never came: nothing to seal
                return
            time.sleep(0.2)
        try:
            record = seal(path, round_, self.rank)
        except OSError as error:
            log.warning("worker_checkpoint_seal_failed", round=round_, path=str(path), error=first_line(error))
            return
        log.info(
            "worker_checkpoint_sealed",
            round=round_,
            files=len(record["files"]),
            bytes=sum(f["bytes"] for f in record["files"].values()),
            hash_seconds=round(time.perf_counter() - started, 3),
        )

    def _wait_sealed(self) -> None:
        for future in self._sealing:
            future.result()
        self._sealing.clear()

    def _wait_all(self) -> None:
        for round_ in list(self._replicas):
            try:
                self._replicas[round_].result()
            except SAVE_ERRORS as error:  # then no replica: a resume from it pulls in full
                log.warning("worker_checkpoint_replica_failed", round=round_, error=first_line(error))
                self._replicas.pop(round_)
        for round_ in list(self._pending):
            try:
                self._pending[round_].result()
            except SAVE_ERRORS as error:  # a failed write is an uncommitted checkpoint, reported
                log.warning("worker_checkpoint_failed", round=round_, error=first_line(error))
                self._pending.pop(round_)

    def close(self) -> None:
        """Finish the writes in flight (they stay uncommitted unless `commit` ran for them, which is said) and
        the commits."""
        self._wait_all()
        for round_ in sorted(self._pending):
            log.warning(
                "worker_checkpoint_uncommitted",
                round=round_,
                path=str(self.path_of(round_)),
                reason="written, but its round's exchange did not reach the shards before the stop: a resume "
                "takes the newest committed one, and the shards say which round to train",
            )
        self._pending.clear()
        self._replicas.clear()
        self._wait_sealed()
        for pool in (self._sealer, self._writer):
            if pool is not None:
                pool.shutdown()
        self._sealer = self._writer = None
        if self._stager is not None:  # its buffers (and their pinning) go
            self._stager.close()
            self._stager = None

    def _prune(self, newest: int) -> None:
        rounds = self.rounds()
        committed = [r for r in rounds if (self.path_of(r) / COMMITTED).exists()]
        stale = [r for r in rounds if r < newest and (r not in committed or r not in committed[-self.keep :])]
        for r in stale:
            shutil.rmtree(self.path_of(r), ignore_errors=True)

    def rounds(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := ROUND_DIR.match(p.name)))

    def newest_committed(self) -> int | None:
        committed = [r for r in self.rounds() if (self.path_of(r) / COMMITTED).exists()]
        return committed[-1] if committed else None
