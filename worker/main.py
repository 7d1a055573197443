"""`dilocox worker`: one cluster training against the aggregation shards."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import signal

import structlog
import torch

from dilocox.common.config.run import ParallelConfig
from dilocox.common.config.run_flags import add_config_arguments, config_from_args
from dilocox.common.config.waits import (
    MARGIN_S,
    PULL_WAIT_S,
    SHARD_WAIT_S,
    STEP_TIMEOUT_S,
    STOP_TIMEOUT_S,
    collective_timeout_for,
    site_wait_problems,
)
from dilocox.common.logs import add_log_format_argument, configure_logging
from dilocox.common.metrics_http import add_metrics_arguments, serve_metrics
from dilocox.common.security import add_security_arguments, security_from_args
from dilocox.site import BuiltinTrainer, DiLoCoX
from dilocox.worker.data.sources import CorpusError
from dilocox.worker.data.token_data import add_data_arguments, load_run_data, run_tokenizer_spec
from dilocox.worker.data.tokenizer import TokenizerError
from dilocox.worker.exchange.access import LocalAccess
from dilocox.worker.exchange.adaptive_steps import steps_controller_for
from dilocox.worker.exchange.admission import LateJoin, RunFinished, RunLengthMismatch
from dilocox.worker.exchange.aggregator_client import AggregatorError
from dilocox.worker.exchange.stop import FORCED_EXIT, STOP_GRACE_S, StopSignal
from dilocox.worker.models.build import model_param_specs
from dilocox.worker.models.spec import ModelSpecError
from dilocox.worker.progress import chain, progress_for
from dilocox.worker.site.launch import relaunch_with_torchrun, under_torchrun
from dilocox.worker.site.size_guard import check_model_size
from dilocox.worker.tracking import add_tracking_arguments, check_tracking_args, tracker_from_args
from dilocox.worker.train.device import DeviceError, prefer_expandable_segments
from dilocox.worker.train.inner_trainer import InnerTrainer
from dilocox.worker.train.pipeline_stage import PipelineSplitError, check_splittable
from dilocox.worker.train.slowdown import SlowedTrainer

log = structlog.get_logger()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--servers", required=True, help="comma-separated host:port of every shard of the aggregation service"
    )
    parser.add_argument("--cluster", help="this cluster's name, unique in the run (default cluster-<index>)")
    parser.add_argument(
        "--cluster-index", type=int, default=0, help="which data shard this cluster trains on (default 0)"
    )
    parser.add_argument(
        "--num-clusters", type=int, default=1, help="how many data shards the corpus is cut into (default 1)"
    )
    add_data_arguments(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument(
        "--simulate-slowdown",
        type=float,
        default=1.0,
        metavar="F",
        help="benchmarks of uneven sites: train at 1/F of this site's speed (each round's steps are "
        "followed by a sleep of F-1 times their duration; default 1: full speed)",
    )
    add_log_format_argument(parser)
    parser.add_argument(
        "--checkpoint-dir",
        type=pathlib.Path,
        help="save the site's local state here after rounds (torch.distributed.checkpoint, one folder per "
        "round under <dir>/<cluster>; every rank of the site must see the same folder)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=1, help="save every k rounds (default 1)")
    parser.add_argument(
        "--checkpoint-every-s",
        type=float,
        default=0.0,
        metavar="S",
        help="instead of every k rounds: save at the first round boundary at least S seconds after the last "
        "save (for rounds much shorter than a checkpoint's write; default 0: by rounds)",
    )
    parser.add_argument("--checkpoint-keep", type=int, default=2, help="committed checkpoints kept (default 2)")
    parser.add_argument(
        "--resume", action="store_true", help="restore the newest committed state from --checkpoint-dir first"
    )
    parser.add_argument(
        "--resume-if-present",
        action="store_true",
        help="--resume when --checkpoint-dir holds a committed checkpoint of this site, else start afresh: "
        "for a job a scheduler may restart (Slurm requeue, a Kubernetes pod) with the same command",
    )
    parser.add_argument(
        "--shard-wait-s",
        type=float,
        default=SHARD_WAIT_S,
        help="how long to wait for an unreachable shard (restarting, link down) before giving up, "
        "retrying as soon as it serves again (default 1800 = 30 min)",
    )
    parser.add_argument(
        "--pull-wait-s",
        type=float,
        default=PULL_WAIT_S,
        help="how long to wait for a round's result once this site's part is pushed, re-pushing "
        "meanwhile (default 3600 = 1 h; keep it above the shards' --round-deadline-s)",
    )
    parser.add_argument(
        "--boundary-margin-s",
        type=float,
        default=MARGIN_S,
        help="a multi-rank site: the boundary's own work (reshard, checkpoint staging, eval) on top of the "
        "waits above; the site's collective timeout is their sum, never shorter than a rank's "
        "legitimate wait (default 600)",
    )
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=STEP_TIMEOUT_S,
        help="a multi-rank site: how long a rank waits in a training collective (FSDP's all-gather and "
        "reduce-scatter, a pipeline send; NCCL on GPUs) for its peers before the site fails — a step "
        "plus a margin (default 600, torch's NCCL default); the exchange's waits end in agreements "
        "on the host, never here",
    )
    parser.add_argument(
        "--stop-grace-s",
        type=float,
        default=STOP_GRACE_S,
        metavar="S",
        help="after SIGTERM or Ctrl-C, how long the exchange in flight still gets, also while the round "
        "boundary waits for a late round's result (default 30; give launchers a step, this and a "
        "checkpoint write before their SIGKILL); a second signal exits at once",
    )
    parser.add_argument(
        "--stop-timeout-s",
        type=float,
        default=STOP_TIMEOUT_S,
        metavar="S",
        help="a multi-rank site this worker starts as its own torchrun job: how long torchrun lets the ranks "
        "stop after a signal before it kills them (default 300; torchrun's own is 30 s)",
    )
    parser.add_argument(
        "--join-late",
        action="store_true",
        help="join a run whose first rounds have closed, training only the rounds left (default: refuse, exit 3)",
    )
    # Served by the cluster's rank 0 only; on this host unless asked (the rendered launchers ask for every
    # interface: Prometheus scrapes them from elsewhere). Before, 0.0.0.0 by default.
    add_metrics_arguments(parser, default_host="127.0.0.1")
    add_tracking_arguments(parser)  # written by the cluster's rank 0 only
    add_security_arguments(parser, "worker")
    add_config_arguments(parser)


def check_world_size(parallel: ParallelConfig) -> None:
    """A torchrun job whose size is not --pp × --dp is refused on every rank at once: two processes of a
    pp1 × dp1 site would both join as the same cluster, and one would wait for the other half an hour."""
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != parallel.world_size:
        world = int(os.environ["WORLD_SIZE"])
        raise SystemExit(
            f"dilocox worker: this torchrun job has {world} processes, but --pp {parallel.pp} × --dp {parallel.dp} "
            f"= {parallel.world_size}: give the layout of its {world} processes, or start {parallel.world_size}"
        )


def _local_processes(parallel: ParallelConfig) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, or all of them where the worker starts the job itself."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_torchrun() else parallel.world_size


def _device_bytes(parallel: ParallelConfig) -> int | None:
    """One GPU's memory where the ranks train on GPUs (None: training state lives in host memory)."""
    if parallel.device == "cpu" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as error:
        raise SystemExit(f"dilocox worker: bad configuration: {error}") from None
    try:
        tls, token = security_from_args(args, "worker")
    except ValueError as error:
        raise SystemExit(f"dilocox worker: {error}") from None
    for problem in site_wait_problems(args.shard_wait_s, args.pull_wait_s, args.boundary_margin_s):
        raise SystemExit(f"dilocox worker: {problem}")
    if not args.stop_grace_s >= 0:
        raise SystemExit(f"dilocox worker: --stop-grace-s must be ≥ 0, got {args.stop_grace_s:g}")
    if not args.stop_timeout_s > args.stop_grace_s:
        raise SystemExit(
            f"dilocox worker: --stop-timeout-s {args.stop_timeout_s:g} must exceed --stop-grace-s "
            f"{args.stop_grace_s:g}: "
            "torchrun would kill the ranks while the exchange still has its grace"
        )
    if not args.step_timeout_s > 0:
        raise SystemExit(f"dilocox worker: --step-timeout-s must be > 0, got {args.step_timeout_s:g}")
    if config.parallel.spill_dir:
        from dilocox.worker.exchange.spill import SpillError, check_spill_dir

        try:
            check_spill_dir(config.parallel.spill_dir)
        except SpillError as error:
            raise SystemExit(f"dilocox worker: {error}") from None
    if config.parallel.optimizer_state != "fp32":  # refused here, not after a torchrun job has built the model
        from dilocox.worker.train.light_adamw import OptimizerStateError, require_torchao

        try:
            require_torchao()
        except OptimizerStateError as error:
            raise SystemExit(f"dilocox worker: {error}") from None
    if not args.simulate_slowdown >= 1:
        raise SystemExit(
            f"dilocox worker: --simulate-slowdown must be ≥ 1 (1: full speed), got {args.simulate_slowdown}"
        )
    if not 0 <= args.cluster_index < args.num_clusters:
        raise SystemExit(f"dilocox worker: --cluster-index {args.cluster_index} outside [0, {args.num_clusters})")
    check_tracking_args(args)
    adopted = run_tokenizer_spec(config.tokenizer, args.data)
    if adopted != config.tokenizer:
        log.info("tokenizer_from_data", data=args.data, tokenizer=adopted)
        config = dataclasses.replace(config, tokenizer=adopted)
    parallel = config.parallel.world_size > 1
    check_world_size(config.parallel)
    if config.parallel.device != "cpu":
        prefer_expandable_segments()
    try:  # before a torchrun job is started, or any weight built, for nothing
        check_model_size(
            config.model,
            config.model.vocab_size,
            config.parallel,
            _local_processes(config.parallel),
            _device_bytes(config.parallel),
            inner=config.inner,
        )
        check_splittable(config.model, config.parallel.pp)
    except (ModelSpecError, PipelineSplitError) as error:
        raise SystemExit(f"dilocox worker: {error}") from None
    if parallel and not under_torchrun():
        relaunch_with_torchrun(config.parallel.world_size, args.stop_timeout_s)  # does not return
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # Between steps, not at any bytecode: the staged checkpoint commits (worker/exchange/stop.py).
    stop = StopSignal(args.stop_grace_s).install(signal.SIGTERM, signal.SIGINT)  # Ctrl-C stops as SIGTERM does
    cluster = args.cluster or f"cluster-{args.cluster_index}"
    mesh = None
    try:
        if parallel:
            from dilocox.worker.site.mesh import SiteMesh

            timeout_s = collective_timeout_for(args.shard_wait_s, args.pull_wait_s, args.boundary_margin_s)
            mesh = SiteMesh(config.parallel, collective_timeout_s=timeout_s, step_timeout_s=args.step_timeout_s)
        data = load_run_data(config.tokenizer, args.data, args.text_field)
        if data.vocab_size != config.model.vocab_size:  # the tokenizer's vocabulary sizes the model: check again
            check_model_size(
                config.model,
                data.vocab_size,
                config.parallel,
                _local_processes(config.parallel),
                _device_bytes(config.parallel),
                inner=config.inner,
            )
        if mesh is None:
            trainer = InnerTrainer(config, data, args.cluster_index, args.num_clusters)
            if args.simulate_slowdown != 1.0:
                trainer = SlowedTrainer(trainer, args.simulate_slowdown)
            access = LocalAccess(trainer.named_parameters())
            extra: dict = {"steps_controller": steps_controller_for(config.inner, single_process=True)}
        else:
            from dilocox.worker.site.access import SiteAccess
            from dilocox.worker.site.trainer import SiteTrainer

            trainer = SiteTrainer(config, data, mesh, args.cluster_index, args.num_clusters)
            access = SiteAccess(mesh, trainer.named_parameters, model_param_specs(config.model, data.vocab_size))
            # Adaptive H decides per rank (off here); a time box's H is agreed over the site's ranks.
            extra = {"steps_controller": steps_controller_for(config.inner, single_process=False)}
    except (CorpusError, TokenizerError, ModelSpecError, PipelineSplitError, DeviceError) as error:
        if mesh is not None:
            mesh.close()
        raise SystemExit(f"dilocox worker: {error}") from None
    compute = mesh.compute if mesh is not None else trainer.compute
    log.info(
        "worker_starting",
        cluster=cluster,
        servers=args.servers,
        model=config.model.model,
        params_held=access.params_held,
        tokenizer=config.tokenizer,
        vocab=data.vocab_size,
        tokens=data.num_tokens,
        streamed=data.streamed,
        device=str(compute.device),
        precision=compute.precision,
    )
    if args.resume and not args.checkpoint_dir:
        raise SystemExit("dilocox worker: --resume needs --checkpoint-dir")
    if args.checkpoint_dir:
        from dilocox.worker.checkpoint import SiteCheckpoint

        try:
            extra["checkpoint"] = SiteCheckpoint(
                args.checkpoint_dir,
                cluster,
                args.checkpoint_every,
                args.checkpoint_keep,
                rank=mesh.rank if mesh else 0,
                replica=mesh.replica if mesh else 0,
                group=mesh.checkpoint_group if mesh else None,
                staging=config.parallel.checkpoint_staging,
                pinned=compute.is_cuda,
                every_s=args.checkpoint_every_s,
                agreement_group=mesh.agreement_group if mesh else None,
            )
        except ValueError as error:
            raise SystemExit(f"dilocox worker: {error}") from None
        if args.resume_if_present and not args.resume:
            args.resume = extra["checkpoint"].newest_committed() is not None
            log.info("resume_if_present", cluster=cluster, resume=args.resume, checkpoint_dir=str(args.checkpoint_dir))
    elif args.resume_if_present:
        raise SystemExit("dilocox worker: --resume-if-present needs --checkpoint-dir")
    # The same site object a user's own loop makes (dilocox.DiLoCoX), over the built-in trainer.
    dx = DiLoCoX(
        None,
        servers=args.servers,
        config=config,
        cluster=cluster,
        num_clusters=args.num_clusters,
        tls=tls,
        token=token,
        tokenizer=(data.tokenizer_digest, data.tokenizer_json),
        shard_wait_s=args.shard_wait_s,
        pull_wait_s=args.pull_wait_s,
        join_late=args.join_late,
        builtin=BuiltinTrainer(trainer, access, **extra),
    )
    metrics_server, progress, tracker = None, None, None
    try:
        if args.resume:
            try:
                extra["checkpoint"].restore(trainer, dx.compressor, access.names, client=dx.client)
            except (ValueError, FileNotFoundError) as error:
                raise SystemExit(f"dilocox worker: {error}") from None
        on_round = None
        if args.metrics_port and (mesh is None or mesh.rank == 0):
            from dilocox.worker.metrics import WorkerMetrics

            metrics = WorkerMetrics(dx.client, run_id=config.run_id, cluster=cluster)
            metrics_server = serve_metrics(
                metrics.registry, args.metrics_port, args.metrics_host, role=cluster, command="dilocox worker"
            )
            on_round = metrics.observe_round
        if mesh is None or mesh.rank == 0:
            progress = progress_for(config.rounds, cluster, args.log_format)
            if progress is not None:
                configure_logging(args.log_format, stream=progress.log_stream())
            tracker = tracker_from_args(args, cluster)
            on_round = chain(on_round, progress, tracker)
        dx.cluster.on_round = on_round
        dx.run_builtin(stop)
    except AggregatorError as error:
        log.error(
            "aggregator_refused", cluster=cluster, address=error.address, code=error.code.name, details=error.details
        )
        return 2
    except (RunFinished, LateJoin) as error:
        event = {RunLengthMismatch: "run_length_refused", RunFinished: "run_finished", LateJoin: "late_join_refused"}[
            type(error)
        ]
        log.error(event, cluster=cluster, reason=str(error))
        return 3
    finally:
        dx.close()
        if compute.is_cuda:  # what a GPU needs for this layout: `dilocox bench gpu` reads it
            log.info(
                "device_memory",
                device=str(compute.device),
                peak_allocated_mb=round(torch.cuda.max_memory_allocated() / 2**20),
                peak_reserved_mb=round(torch.cuda.max_memory_reserved() / 2**20),
            )
        if metrics_server is not None:
            metrics_server.close()
        if progress is not None:
            progress.close()
        if tracker is not None:
            tracker.close()
        if mesh is not None:
            mesh.close()
    if dx.cluster.stopped_by is not None:
        log.info("worker_stopped", cluster=cluster, signal=dx.cluster.stopped_by, round=dx.cluster.round)
        return stop.exit_code if stop.requested else FORCED_EXIT
    return 0
