"""Run tracking: each round's scalars of one site as TensorBoard events and, optionally, in W&B.

Why beside the Prometheus metrics (worker/metrics.py): those answer "is the job healthy now" and are gone
with the scrape retention; a pre-training run also wants its curves (losses, throughput, what the WAN cost,
where the adaptive rank and H settled) kept with the run, to compare runs after they ended, without a
monitoring stack. One point per round and scalar, step = the round, written by the site's rank 0 (byte
counts, the residual and the rank are that rank's share of the site), flushed after every round so a
killed run keeps its curve up to its last round.

`tensorboard` and `wandb` are optional packages (`pip install 'dilocox[tracking]'`): imported only when
asked for, and a flag asking for a missing one stops the worker at start with the command that installs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
from typing import TYPE_CHECKING, Protocol

import structlog

if TYPE_CHECKING:
    from dilocox.worker.exchange.round_report import RoundReport

log = structlog.get_logger()

WANDB_MODES = ("offline", "online")


def add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensorboard-dir",
        type=pathlib.Path,
        metavar="DIR",
        help="write each round's scalars (losses, tokens/s, bytes, idle s, rank, H, residual norm) as "
        "TensorBoard events under DIR/<cluster>, one run per site (by rank 0; needs: "
        "pip install 'dilocox[tracking]')",
    )
    parser.add_argument(
        "--wandb-project",
        metavar="NAME",
        help="also log them to this Weights & Biases project, one run per cluster (needs: pip install wandb)",
    )
    parser.add_argument(
        "--wandb-mode",
        choices=WANDB_MODES,
        default="offline",
        help="offline (default): keep the W&B run in a local folder (WANDB_DIR), upload later with "
        "`wandb sync`, no network or API key needed; online: stream it to the W&B server",
    )


def round_scalars(report: RoundReport, inner_steps: int) -> dict[str, float]:
    """{tag: value} of one round; a NaN (a round without evaluation, a trainer that gave no loss) is left out
    rather than drawn as a gap or a spike."""
    scalars = {
        "loss/train": report.train_loss,
        "loss/eval": report.eval_loss,
        "tokens/round": report.tokens,
        "tokens/per_s": report.tokens / report.seconds if report.seconds > 0 else 0.0,
        "bytes/up": report.bytes_up,
        "bytes/down": report.bytes_down,
        "time/round_s": report.seconds,
        "time/compute_s": report.compute_s,
        "time/comm_s": report.comm_s,
        "time/idle_s": report.idle_s,
        "exchange/overlap": report.overlap,
        "exchange/rank": report.compress_rank,
        "exchange/inner_steps": inner_steps,
        "exchange/residual_norm": report.residual_norm,
        "exchange/late": float(report.late),
    }
    return {tag: float(value) for tag, value in scalars.items() if not math.isnan(value)}


class Sink(Protocol):
    """One destination of the scalars."""

    def write(self, scalars: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under `logdir`, flushed every round (TensorBoard reads them while the run goes on)."""

    def __init__(self, logdir: pathlib.Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.logdir = logdir
        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per cluster; the same tags, step = the round."""

    def __init__(self, project: str, name: str, mode: str) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, mode=mode)

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class RunTracker:
    """`on_round` observer (DilocoCluster's hook, as `chain`ed in worker/main.py) writing to every sink.

    A sink that fails (a full disk, a tracker server gone) is dropped with a warning: losing a dashboard
    must not stop a pre-training run."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = list(sinks)

    def observe_round(self, report: RoundReport, inner_steps: int, version: int) -> None:
        scalars = round_scalars(report, inner_steps)
        for sink in list(self.sinks):
            try:
                sink.write(scalars, report.round)
            except Exception as error:  # noqa: BLE001 - third-party writers raise anything
                log.warning("tracking_failed", sink=type(sink).__name__, round=report.round, error=str(error))
                self.sinks.remove(sink)

    __call__ = observe_round

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as error:  # noqa: BLE001 - the run is over: report, do not fail it
                log.warning("tracking_close_failed", sink=type(sink).__name__, error=str(error))
        self.sinks = []


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def check_tracking_args(args: argparse.Namespace, command: str = "dilocox worker") -> None:
    """Before a model is built or torchrun started, on every rank alike: a flag asking for a package that is
    not installed stops the worker with the command that installs it."""
    if args.tensorboard_dir is not None and not tensorboard_available():
        raise SystemExit(f"{command}: --tensorboard-dir needs the tensorboard package: pip install 'dilocox[tracking]'")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise SystemExit(f"{command}: --wandb-project needs the wandb package: pip install wandb")


def tracker_from_args(args: argparse.Namespace, cluster: str, command: str = "dilocox worker") -> RunTracker | None:
    """The tracker the flags ask for (None: none asked for); `check_tracking_args` has vetted the packages."""
    sinks: list[Sink] = []
    if args.tensorboard_dir is not None:
        try:
            sinks.append(TensorBoardSink(args.tensorboard_dir / cluster))
        except OSError as error:
            raise SystemExit(
                f"{command}: cannot write TensorBoard events under {args.tensorboard_dir}: {error}"
            ) from None
        log.info("tracking_tensorboard", cluster=cluster, logdir=str(args.tensorboard_dir / cluster))
    if args.wandb_project:
        try:
            sinks.append(WandbSink(args.wandb_project, cluster, args.wandb_mode))
        except Exception as error:  # noqa: BLE001 - wandb.init's errors (no API key online, a bad project) vary
            raise SystemExit(f"{command}: cannot start the W&B run: {error}") from None
        log.info("tracking_wandb", cluster=cluster, project=args.wandb_project, mode=args.wandb_mode)
    return RunTracker(sinks) if sinks else None
