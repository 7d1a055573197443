"""`dilocox server`: run one aggregation shard until SIGTERM/SIGINT."""

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
from dilocox.common.config.run import OuterConfig, WireConfig
from dilocox.common.config.waits import refusal
from dilocox.common.heap import keep_freed_heap
from dilocox.common.logs import add_log_format_argument, configure_logging
from dilocox.common.metrics_http import add_metrics_arguments, serve_metrics
from dilocox.common.security import add_security_arguments, security_from_args
from dilocox.common.signing_keys import SigningError, load_signer
from dilocox.common.wire.checkpoint_format import CheckpointCorrupt, CheckpointError, shard_files
from dilocox.common.wire.staleness import DEFAULT_MAX_WEIGHT_MULTIPLE
from dilocox.server.checks.robust_mean import AGGREGATES, AggregateConfig
from dilocox.server.checks.update_check import MODES, UpdateCheckConfig
from dilocox.server.rounds.grace import GraceWindow
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.serving.health_watch import STALL_S
from dilocox.server.serving.pull_framing import DEFAULT_BUDGET_MB
from dilocox.server.serving.push_intake import PushLimits
from dilocox.server.shard import DEFAULT_KEEP_ROUNDS, Shard
from dilocox.server.state import checkpoint, resume
from dilocox.server.state.checkpoint_signing import CheckpointTrust, signing
from dilocox.server.state.rounds_on_disk import DEFAULT_KEEP_ROUNDS_DISK_GB, DEFAULT_KEEP_ROUNDS_S, RoundsOnDisk

log = structlog.get_logger()
# How often the main thread looks for a SIGTERM/SIGINT its handler noted (the stop is this much later at most).
SIGNAL_POLL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-shards", type=int, default=1, help="total shards of the aggregation service (default 1)")
    parser.add_argument("--shard-index", type=int, default=0, help="which shard this process is, 0-based (default 0)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on; 0 picks a free one (default 50051)")
    parser.add_argument("--port-file", type=pathlib.Path, help="write the bound port here once serving")
    parser.add_argument("--run-id", default="dilocox-sim", help="run this shard serves; other runs are refused")
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=OuterConfig.lr,
        help=f"outer Nesterov learning rate η (default {OuterConfig.lr})",
    )
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=OuterConfig.momentum,
        help=f"outer momentum μ (default {OuterConfig.momentum})",
    )
    parser.add_argument(
        "--min-clusters", type=int, default=1, help="contributions a round needs before it may close (default 1)"
    )
    parser.add_argument(
        "--expect-clusters",
        type=int,
        help="the run's sites: its first round does not close before this many have joined (default: --min-clusters). "
        "Give it the number of sites when --min-clusters is lower (a quorum), so a site that starts slower than the "
        "others' first round is not refused as a late joiner; with --round-deadline-s, round 1 closes without a site "
        "that has not joined that long after its first push",
    )
    parser.add_argument(
        "--round-deadline-s",
        type=float,
        default=300.0,
        help="close a round this long after its first contribution with the clusters that completed it "
        "(≥ --min-clusters); the rest are marked inactive and must rejoin (default 300; 0 = wait forever)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="close a round on a quorum: once --min-clusters have delivered, wait at most this long for the rest "
        "(adapted to how far apart sites arrive lately), then close without them; a late site stays in the run and its "
        "part goes with its next push. With it, --round-deadline-s only marks a site gone that pushed nothing for that "
        "long (default 0 = off: wait for every site, up to --round-deadline-s)",
    )
    parser.add_argument(
        "--grace-min-s",
        type=float,
        default=0.0,
        help="with --grace-s: the shortest grace window the adaptation may choose (default 0)",
    )
    parser.add_argument(
        "--keep-rounds",
        type=int,
        default=DEFAULT_KEEP_ROUNDS,
        help="keep the contributions of this many newest versions, so a site that comes back up to that many "
        "versions behind (a restart from its checkpoint) pulls those rounds instead of the weights and momentum in "
        f"full; costs their compressed bytes in memory (default {DEFAULT_KEEP_ROUNDS}; 1 = the newest only)",
    )
    parser.add_argument(
        "--keep-rounds-s",
        type=float,
        default=DEFAULT_KEEP_ROUNDS_S,
        help="also keep every version's contributions on disk (--keep-rounds-dir) for this long, so a site back "
        "within it "
        "(a requeue, a reschedule, a night away) resumes by delta, not by pulling the whole model; 0 = memory only "
        f"(--keep-rounds). Default {DEFAULT_KEEP_ROUNDS_S:g} (a day)",
    )
    parser.add_argument(
        "--keep-rounds-dir",
        type=pathlib.Path,
        help="where --keep-rounds-s keeps them (default: <--checkpoint-dir>/recent-rounds; without either, "
        "memory only)",
    )
    parser.add_argument(
        "--keep-rounds-disk-gb",
        type=float,
        help="at most this much disk for them: past it the oldest go first, and the shard says how far back it "
        f"then reaches (recent_rounds_budget_reached). Default: half the folder's free space at start, at most "
        f"{DEFAULT_KEEP_ROUNDS_DISK_GB:g} (84 MB a site and round at 107B), so they never crowd out the "
        "checkpoints on a shared volume",
    )
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, help="write shard-<index>.pt here (atomically)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=1, help="checkpoint every k published versions (default 1)"
    )
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="keep serving after the run's end (default: exit once every cluster has pulled the final version)",
    )
    parser.add_argument(
        "--checkpoint-keep", type=int, default=3, help="checkpoints kept: this version and earlier ones (default 3)"
    )
    parser.add_argument("--resume", action="store_true", help="restart from the checkpoint in --checkpoint-dir")
    parser.add_argument(
        "--resume-if-present",
        action="store_true",
        help="--resume when --checkpoint-dir holds a checkpoint of this shard, else start the run: for "
        "orchestrators that start a shard the same way over its volume, first empty (Kubernetes)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="with --resume: raise the run's rounds to this (train a finished run longer, keeping its weights "
        "and outer momentum; then start the sites with --resume --rounds N; docs/deploy.md)",
    )
    parser.add_argument(
        "--checkpoint-sign-key",
        metavar="KEY_PEM",
        help="sign every checkpoint with this private key (PEM: ECDSA as `dilocox certs` makes, Ed25519 or "
        "RSA), so a resume can refuse a changed file even when its digest was recomputed",
    )
    parser.add_argument(
        "--checkpoint-sign-cert",
        metavar="CERT_PEM",
        help="with --checkpoint-sign-key: its certificate (then any intermediates), for --checkpoint-ca",
    )
    trust = parser.add_mutually_exclusive_group()
    trust.add_argument(
        "--checkpoint-verify-key",
        metavar="PUBLIC_PEM",
        help="with --resume: restore only a checkpoint signed by this key (a public key or its certificate); "
        "an unsigned or changed one is refused by name, as a damaged one (an older kept version that "
        "verifies is used instead)",
    )
    trust.add_argument(
        "--checkpoint-ca",
        metavar="CA_PEM",
        help="with --resume: restore only a checkpoint signed with a certificate from this CA (--checkpoint-sign-cert)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start a new run over a --checkpoint-dir that holds one: move the old checkpoints aside first",
    )
    parser.add_argument(
        "--push-idle-timeout-s",
        type=float,
        default=PushLimits.idle_timeout_s,
        help="refuse a push stream that sends nothing for this long (UNAVAILABLE; nothing of it applied, "
        "the site pushes again): well above one chunk's transfer time on the slowest site's link",
    )
    parser.add_argument(
        "--push-streams-per-cluster",
        type=int,
        default=PushLimits.streams_per_cluster,
        help="push streams one cluster identity may hold open at this shard at once (RESOURCE_EXHAUSTED "
        "past it); a site opens one per rank",
    )
    parser.add_argument(
        "--pull-cache-mb",
        type=int,
        default=DEFAULT_BUDGET_MB,
        help="memory for pull chunks framed once per version and sent to every cluster that pulls the same "
        "bytes (other clusters' contributions, the weights); a larger stream is framed per pull; 0: off",
    )
    checks = UpdateCheckConfig()
    parser.add_argument(
        "--update-check",
        default=checks.mode,
        choices=MODES,
        help="look at each site's update before the merge, against the round's peers (its norm against the "
        "other sites' accepted ones, its cosine with the other sites' mean — with two sites, with the other "
        "site, the previous round's update breaking a tie — a replayed payload): warn logs and counts; clip "
        "merges an update flagged only for its size scaled down to the reference norm and leaves any other "
        "flagged one out; exclude leaves every flagged or quarantined site out of the round. Neither acts "
        "on more than --update-check-max-flagged of a round (docs/decisions.md)",
    )
    parser.add_argument(
        "--update-check-norm-ratio",
        type=float,
        default=checks.norm_ratio,
        help="flag an update whose norm exceeds this many times the median of the other sites' norms accepted lately",
    )
    parser.add_argument(
        "--update-check-min-cosine",
        type=float,
        default=checks.min_cosine,
        help="flag an update whose cosine with the other sites' mean (3 or more sites) is below this; of two "
        "sites below it with each other, the one whose cosine with the previous round's update is below "
        "it and the lower",
    )
    parser.add_argument(
        "--update-check-min-agreement",
        type=float,
        default=checks.min_agreement,
        help="judge a site's direction only where the other sites agree among themselves at least this much "
        "(their mean pairwise cosine; with two sites, where the pair's cosine is below minus this): late "
        "in training honest updates are mostly noise and a cosine bound alone flags honest sites",
    )
    parser.add_argument(
        "--update-check-max-flagged",
        type=float,
        default=checks.max_flagged,
        help="act (clip, exclude, quarantine) only while at most this share of a round's sites is flagged; "
        "above it the round merges as usual and the shard logs update_check_overruled (default 0.5: "
        "never a majority)",
    )
    parser.add_argument(
        "--update-check-quarantine-rounds",
        type=int,
        default=checks.quarantine_rounds,
        help="flagged this many rounds in a row, a site is quarantined: with exclude or clip, left out "
        "until it passes as many rounds in a row or an operator readmits it (dilocox readmit)",
    )
    parser.add_argument(
        "--max-weight-multiple",
        type=float,
        default=DEFAULT_MAX_WEIGHT_MULTIPLE,
        help="a site's weight in a round's mean is at most this many times the median of the other sites' "
        "tokens: tokens are a claim, and one site saying 1000x the others' would take over the step "
        "(the round record keeps both; 0: weigh as said)",
    )
    parser.add_argument(
        "--aggregate",
        default="mean",
        choices=AGGREGATES,
        help="a round's step: the sites' weighted mean, or clipped-mean — each site's update scaled down to at "
        "most --aggregate-clip-multiple times the median of the other sites' norms first, so a site under "
        "the update check's bounds still moves the step by a bounded share (server/checks/robust_mean.py)",
    )
    parser.add_argument(
        "--aggregate-clip-multiple",
        type=float,
        default=AggregateConfig().clip_multiple,
        help="clipped-mean: the bound, as a multiple of the median of the other sites' update norms",
    )
    parser.add_argument(
        "--operator-token",
        default=None,
        help="what an operator's request must carry (dilocox readmit: release a site the update check "
        "quarantined); keep it from the sites, which hold the run token only (default: none, such "
        "requests refused; also $DILOCOX_OPERATOR_TOKEN)",
    )
    parser.add_argument(
        "--health-stall-s",
        type=float,
        default=STALL_S,
        help="report NOT_SERVING (grpc.health.v1) while a task has waited this long for one of the shard's "
        "work threads, SERVING again once it ran: orchestrators' probes then act on a wedged shard",
    )
    parser.add_argument(
        "--work-threads",
        type=int,
        default=None,
        help="threads that decode pushes, frame pulls and close rounds (default: the CPUs this process may "
        "use + 2, at most 32; no thread waits on the network, so more only contend for the interpreter)",
    )
    parser.add_argument(
        "--added-latency-ms",
        type=float,
        default=0.0,
        help="delay every push and pull by this much: user-space WAN latency for tests (this kernel has no netem)",
    )
    add_log_format_argument(parser)
    add_metrics_arguments(parser, default_host=None)
    add_security_arguments(parser, "server")


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
