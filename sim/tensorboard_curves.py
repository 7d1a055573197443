"""Where a sim's clusters write their TensorBoard curves, and the command that shows them.

Its own module because it is the sim's one optional dependency: whether the tensorboard package is
installed decides it, and a missing package is said once and run without rather than failed on.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex

import structlog

from dilocox.worker.tracking import tensorboard_available

log = structlog.get_logger()


def tensorboard_dir(args: argparse.Namespace, log_dir: pathlib.Path) -> pathlib.Path | None:
    """Where the clusters write their TensorBoard scalars: on by default, so every sim leaves its curves;
    without the tensorboard package the sim says so once and runs without them rather than failing."""
    if args.no_tensorboard:
        return None
    if not tensorboard_available():
        log.warning(
            "sim_tensorboard_off",
            reason="the tensorboard package is not installed",
            fix="pip install 'dilocox[tracking]'",
        )
        return None
    return log_dir / "tensorboard"


def log_tensorboard_command(tensorboard_dir: pathlib.Path | None) -> None:
    """The command that shows the run's curves (the clusters' event files appear as one run each)."""
    if tensorboard_dir is not None:
        log.info("sim_tensorboard", command=f"tensorboard --logdir {shlex.quote(str(tensorboard_dir))}")
