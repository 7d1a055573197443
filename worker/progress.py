"""A progress bar of the run's rounds for a person watching a worker in a terminal.

Why only in a TTY: a worker under docker, systemd or a test writes structlog lines that machines read;
a bar's carriage returns would garble them. On a terminal the bar shows how far the run is and the
latest losses, while the key=value log lines keep scrolling above it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TextIO


class RoundProgress:
    """`on_round` observer: one bar step per round, with train/eval loss and idle time as postfix."""

    def __init__(self, total_rounds: int, cluster: str, stream: TextIO | None = None) -> None:
        import tqdm

        self.last_eval: float | None = None
        self.bar = tqdm.tqdm(
            total=total_rounds, desc=cluster, unit="round", file=stream or sys.stderr, dynamic_ncols=True
        )

    def __call__(self, report, inner_steps: int, version: int) -> None:  # noqa: ANN001 - a cluster.RoundReport
        if not math.isnan(report.eval_loss):  # rounds without an evaluation keep showing the last one
            self.last_eval = report.eval_loss
        postfix = {"train": f"{report.train_loss:.3f}", "H": inner_steps, "idle": f"{report.idle_s:.1f}s"}
        if self.last_eval is not None:
            postfix["eval"] = f"{self.last_eval:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(max(0, report.round - self.bar.n))  # a rejoin can skip rounds: follow the round number

    def log_stream(self) -> AboveTheBar:
        """A stream for the log lines that prints them above the bar instead of through it."""
        return AboveTheBar(self.bar)

    def close(self) -> None:
        self.bar.close()


class AboveTheBar:
    """File-like: each write clears the bar, prints the text, and redraws the bar (tqdm.write)."""

    def __init__(self, bar) -> None:  # noqa: ANN001 - a tqdm bar
        self.bar = bar

    def write(self, text: str) -> int:
        self.bar.write(text.rstrip("\n"), file=self.bar.fp)
        return len(text)

    def flush(self) -> None:
        self.bar.fp.flush()


def progress_for(
    total_rounds: int, cluster: str, log_format: str, stream: TextIO | None = None
) -> RoundProgress | None:
    """A bar when `stream` (stderr) is a terminal and the logs are for people; else None."""
    stream = stream or sys.stderr
    if log_format != "kv" or not stream.isatty():
        return None
    try:
        return RoundProgress(total_rounds, cluster, stream)
    except ImportError:
        return None


def chain(*observers: Callable | None) -> Callable | None:
    """One `on_round` callable calling every given observer in order (None when there are none)."""
    present = [o for o in observers if o is not None]
    if not present:
        return None

    def observe(*args) -> None:
        for observer in present:
            observer(*args)

    return observe
