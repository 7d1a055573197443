"""`dilocox server`: run one aggregation shard until SIGTERM/SIGINT.

Its flags are server/flags.py's table (`add_arguments`, imported here because common/cli.py calls a command
module's `add_arguments` and `run`); this module is what a started shard does with them."""

from __future__ import annotations

import argparse
import pathlib
import shutil
import signal
import threading
import time

import structlog

from dilocox.common.atomic_file import write_text_atomic
from dilocox.common.collector import settle_collector
from dilocox.common.config.run import WireConfig
from dilocox.common.config.waits import refusal
from dilocox.common.heap import keep_freed_heap
from dilocox.common.logs import configure_logging
from dilocox.common.metrics_http import serve_metrics
from dilocox.common.security import security_from_args
from dilocox.common.signing_keys import SigningError, load_signer
from dilocox.common.wire.checkpoint_format import CheckpointCorrupt, CheckpointError, shard_files
from dilocox.server.checks.robust_mean import AggregateConfig
from dilocox.server.checks.update_check import UpdateCheckConfig
from dilocox.server.flags import add_arguments  # noqa: F401  (the CLI calls this module's add_arguments and run)
from dilocox.server.rounds.grace import GraceWindow
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.serving.push_intake import PushLimits
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint, resume
from dilocox.server.state.checkpoint_signing import CheckpointTrust, signing
from dilocox.server.state.rounds_on_disk import DEFAULT_KEEP_ROUNDS_DISK_GB, RoundsOnDisk

log = structlog.get_logger()
# How often the main thread looks for a SIGTERM/SIGINT its handler noted (the stop is this much later at most).
SIGNAL_POLL_S = 0.2


def _describe(path: pathlib.Path, shard: Shard) -> str:
    try:
        state = checkpoint.load(path)
    except CheckpointCorrupt:  # damaged: say what --resume would fall back to
        return resume.describe_refusal(path.parent, shard.shard_index, {})
    except ValueError as error:  # unreadable for another reason: still not ours to overwrite
        return f"a checkpoint that cannot be used ({error})"
    version = state["snapshot"]["version"] if state.get("snapshot") else -1
    return f"run {state.get('run_id')!r} at version {version}"


def _checkpoint_keys(args: argparse.Namespace):  # noqa: ANN202
    """(the checkpoint signer, whose signatures a resume trusts), each None where not asked for; checked
    before anything is restored or served."""
    signs, trusts = (
        args.checkpoint_sign_key or args.checkpoint_sign_cert,
        args.checkpoint_verify_key or args.checkpoint_ca,
    )
    if (signs or trusts) and not args.checkpoint_dir:
        raise SystemExit("dilocox server: signing or verifying checkpoints needs --checkpoint-dir")
    if trusts and not (args.resume or args.resume_if_present):
        raise SystemExit(
            "dilocox server: --checkpoint-verify-key / --checkpoint-ca check the checkpoint --resume restores: give "
            "--resume"
        )
    if args.checkpoint_sign_cert and not args.checkpoint_sign_key:
        raise SystemExit(
            "dilocox server: --checkpoint-sign-cert needs --checkpoint-sign-key (the certificate's private key)"
        )
    try:
        signer = (
            load_signer(
                args.checkpoint_sign_key, args.checkpoint_sign_cert, ("--checkpoint-sign-key", "--checkpoint-sign-cert")
            )
            if args.checkpoint_sign_key
            else None
        )
        trust = CheckpointTrust.load(args.checkpoint_verify_key, args.checkpoint_ca)
    except SigningError as error:
        raise SystemExit(f"dilocox server: {error}") from None
    if trust is not None and signer is None:
        log.warning(
            "checkpoints_unsigned",
            shard=args.shard_index,
            reason="--resume checks signatures but no --checkpoint-sign-key "
            "was given: the checkpoints this shard writes from now on are unsigned, and a resume that checks will "
            "refuse them",
        )
    return signer, trust


FINAL_SAVE_RETRY_S = 10.0


def _save_final_version(shard, checkpointer, signalled: list[int], checkpoint_dir, port: int) -> bool:  # noqa: ANN001
    """At the run's end, still serving: save the final version, and while the storage refuses it, say so at
    error level — with the two ways out: free space (retried every `FINAL_SAVE_RETRY_S`), or export the
    final model from the live shards now — and keep serving, so that the export can read it. False only
    when a signal ends the wait first. Before, the shard stopped at once with exit 1 and an info line, and
    its final version was on no disk and could no longer be exported."""
    attempts = 0
    while not checkpointer.save_now():
        attempts += 1
        log.error(
            "final_checkpoint_failed",
            shard=shard.shard_index,
            version=shard.version,
            kept_version=checkpointer.written_version,
            checkpoint_dir=str(checkpoint_dir),
            attempts=attempts,
            retry_in_s=FINAL_SAVE_RETRY_S,
            recover=f"free space in {checkpoint_dir} (the save is retried every {FINAL_SAVE_RETRY_S:g} s), or export "
            "the final "
            f"model from the live shards now — `dilocox export --servers <every shard, this one on port {port}> "
            "--out DIR` — then stop the shard (SIGTERM); it serves until then",
        )
        deadline = time.monotonic() + FINAL_SAVE_RETRY_S
        while time.monotonic() < deadline:
            if signalled:
                return False
            time.sleep(SIGNAL_POLL_S)
    if attempts:
        log.info("final_checkpoint_saved", shard=shard.shard_index, version=shard.version, attempts=attempts + 1)
    return True


def _keep_rounds_on_disk(shard, args: argparse.Namespace) -> None:  # noqa: ANN001
    """Keep every version's contributions on disk for --keep-rounds-s (server/state/rounds_on_disk.py), where
    there is a folder for them."""
    folder = args.keep_rounds_dir or (args.checkpoint_dir / "recent-rounds" if args.checkpoint_dir else None)
    if args.keep_rounds_s <= 0 or folder is None:
        log.info(
            "recent_rounds_in_memory_only",
            shard=args.shard_index,
            keep_rounds=args.keep_rounds,
            why="--keep-rounds-s 0" if args.keep_rounds_s <= 0 else "no --checkpoint-dir or --keep-rounds-dir",
            effect=f"a site more than {args.keep_rounds} versions behind pulls the whole model",
        )
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        budget = (
            int(args.keep_rounds_disk_gb * 1e9)
            if args.keep_rounds_disk_gb is not None
            else min(int(DEFAULT_KEEP_ROUNDS_DISK_GB * 1e9), shutil.disk_usage(folder).free // 2)
        )
        disk = RoundsOnDisk(folder, args.shard_index, args.run_id, args.keep_rounds_s, max(budget, 1))
        shard.recent.keep_on_disk(disk, shard.snapshot, resumed=bool(args.resume))
    except (ValueError, OSError) as error:
        raise SystemExit(f"dilocox server: --keep-rounds-dir {folder}: {error}") from None


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    keep_freed_heap()  # a message's buffers reused, not faulted in afresh (common/heap.py)
    try:
        tls, token = security_from_args(args, "server")
    except ValueError as error:
        raise SystemExit(f"dilocox server: {error}") from None
    refused = refusal(args.round_deadline_s, args.grace_s)
    if refused:
        raise SystemExit(f"dilocox server: {refused}")
    try:
        shard = Shard(
            args.shard_index,
            args.num_shards,
            args.run_id,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            min_clusters=args.min_clusters,
            expect_clusters=args.expect_clusters,
            round_deadline_s=args.round_deadline_s or None,
            grace=GraceWindow(args.grace_min_s, args.grace_s) if args.grace_s > 0 else None,
            keep_rounds=args.keep_rounds,
            update_check=UpdateCheckConfig(
                args.update_check,
                args.update_check_norm_ratio,
                args.update_check_min_cosine,
                args.update_check_quarantine_rounds,
                max_flagged=args.update_check_max_flagged,
                min_agreement=args.update_check_min_agreement,
            ),
            operator_token=args.operator_token or None,
            max_weight_multiple=args.max_weight_multiple,
            aggregate=AggregateConfig(args.aggregate, args.aggregate_clip_multiple),
        )
    except ValueError as error:
        raise SystemExit(f"dilocox server: {error}") from None
    checkpointer = None
    if args.resume_if_present:
        if not args.checkpoint_dir:
            raise SystemExit("dilocox server: --resume-if-present needs --checkpoint-dir")
        args.resume = args.resume or bool(shard_files(args.checkpoint_dir).get(args.shard_index))
    if args.resume and not args.checkpoint_dir:
        raise SystemExit("dilocox server: --resume needs --checkpoint-dir")
    if args.rounds is not None and not args.resume:
        raise SystemExit(
            "dilocox server: --rounds extends a run from its checkpoint and needs --resume (a new run's "
            "rounds come from its sites)"
        )
    if args.resume and args.fresh:
        raise SystemExit("dilocox server: --resume and --fresh exclude each other")
    signer, trust = _checkpoint_keys(args)
    if args.checkpoint_dir:
        path = checkpoint.checkpoint_path(args.checkpoint_dir, args.shard_index)
        held = shard_files(args.checkpoint_dir).get(args.shard_index, [])  # shard-<i>.pt, or only kept versions
        if held and not args.resume:
            if not args.fresh:
                raise SystemExit(
                    f"dilocox server: {held[0]} holds {_describe(held[0], shard)}: restart with --resume to continue "
                    "it, or "
                    "--fresh to move it aside and start a new run (starting empty would overwrite it)"
                )
            log.warning(
                "checkpoints_moved_aside",
                shard=args.shard_index,
                to=str(checkpoint.move_aside(args.checkpoint_dir, args.shard_index)),
            )
        if args.resume:
            started = time.perf_counter()
            expect = {"run_id": shard.run_id, "shard_index": shard.shard_index, "num_shards": shard.num_shards}
            try:  # the newest intact checkpoint: a damaged newer one is moved aside (resume.py says why that is safe)
                path, state = resume.load_for_resume(
                    args.checkpoint_dir, args.shard_index, expect, trust.check if trust else None
                )
                checkpoint.restore(shard, state)
            except CheckpointError as error:
                raise SystemExit(f"dilocox server: {error}") from None
            except (ValueError, KeyError, TypeError) as error:  # a verified file this build cannot restore
                raise SystemExit(f"dilocox server: cannot resume from {path}: {error!r}") from None
            del state
            if args.rounds is not None:
                try:
                    shard.extend_rounds(args.rounds)
                except ValueError as error:
                    raise SystemExit(f"dilocox server: {error}") from None
            log.info(
                "checkpoint_loaded",
                shard=args.shard_index,
                path=str(path),
                bytes=path.stat().st_size,
                seconds=round(time.perf_counter() - started, 3),
            )
        try:
            checkpointer = checkpoint.Checkpointer(
                shard,
                args.checkpoint_dir,
                args.checkpoint_every,
                args.checkpoint_keep,
                signing(signer) if signer else None,
            )
        except ValueError as error:
            raise SystemExit(f"dilocox server: {error}") from None
        shard.on_publish = checkpointer
    _keep_rounds_on_disk(shard, args)
    metrics_server = None
    if args.metrics_port:
        from dilocox.server.metrics import ShardMetrics

        metrics_server = serve_metrics(
            ShardMetrics(shard).attach().registry,
            args.metrics_port,
            args.metrics_host or args.host,
            role=f"shard-{args.shard_index}",
            command="dilocox server",
        )
    # The graceful stop is armed before the port opens: a SIGTERM from the first moment the shard listens
    # (a prober that sees the port, a launcher's early cancel) saves and exits 0, not a bare kill.
    # The handler only notes the signal: it runs on the main thread between two bytecodes, perhaps inside
    # `stop.wait()` holding the Event's lock or inside a log write holding the output's lock, so setting the
    # Event or logging there could deadlock (a shard once ignored a SIGTERM sent the moment it listened).
    stop = threading.Event()
    signalled: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: signalled.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: signalled.append(signum))
    try:
        server, port = start_server(
            shard,
            args.host,
            args.port,
            WireConfig(),
            added_latency_s=args.added_latency_ms / 1000,
            tls=tls,
            token=token,
            push_limits=PushLimits(args.push_idle_timeout_s, args.push_streams_per_cluster),
            health_stall_s=args.health_stall_s,
            pull_cache_bytes=args.pull_cache_mb << 20,
            max_workers=args.work_threads,
        )
    except (ValueError, OSError, RuntimeError) as error:
        raise SystemExit(f"dilocox server: {error}") from None
    settle_collector()  # start-up's objects out of every later collection (common/collector.py)
    if args.port_file:
        write_text_atomic(args.port_file, str(port))
    if not args.keep_serving:

        def on_finished() -> None:
            log.info("shard_stopping", shard=args.shard_index, reason="every cluster holds the run's final version")
            stop.set()

        shard.on_finished = on_finished
    while not signalled and not stop.wait(SIGNAL_POLL_S):
        pass
    saved = None
    if not signalled and checkpointer is not None:  # the run's end: its final version must reach the disk
        saved = _save_final_version(shard, checkpointer, signalled, args.checkpoint_dir, port)
    if signalled:
        log.info("shard_stopping", shard=args.shard_index, signal=signal.Signals(signalled[0]).name)
    server.stop(grace=2.0).wait()
    shard.recent.close()
    if metrics_server is not None:
        metrics_server.close()
    if saved is None:
        saved = checkpointer is None or checkpointer.save_now()  # a refused save is logged (checkpoint_failed) there
    state = {k: v for k, v in shard.status().items() if k in ("version", "bytes_in", "bytes_out")}
    if not saved:
        kept = checkpointer.written_version if checkpointer else None
        log.error(
            "shard_stopped_unsaved",
            shard=args.shard_index,
            kept_version=kept,
            checkpoint_dir=str(args.checkpoint_dir),
            **state,
            effect=f"version {state.get('version')} is on no disk: a restart with --resume starts from version "
            f"{kept}, and "
            "the sites' --resume brings them back to it (docs/operations.md, 'Damaged checkpoints and full disks')",
        )
        return 1
    log.info("shard_stopped", shard=args.shard_index, saved=saved, **state)
    return 0
