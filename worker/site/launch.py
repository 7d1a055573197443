"""Starting a site: a `dilocox worker --pp P --dp D` that is not under torchrun yet becomes one.

On one machine the worker runs a standalone torchrun job of P × D copies of itself, in this process
(torch's launcher, `torch.distributed.run.main`). Across nodes, start torchrun yourself on every node with
the same rendezvous (docs/deploy.md); the worker sees RANK/WORLD_SIZE and joins the job instead.

A SIGTERM (an operator, Slurm, Kubernetes) is handed by torch's launcher to every rank, which stop as
they do alone; the launcher itself then raises an exception carrying the signal. It is caught here, so a
clean stop ends with one log line and exit code 128 + signal, not the launcher's traceback.
"""

from __future__ import annotations

import os
import sys

import structlog

from dilocox.common.config.waits import SHUTDOWN_TIMEOUT_ENV, STOP_TIMEOUT_S

log = structlog.get_logger()


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_with_torchrun(world_size: int, stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Run a standalone torchrun job of `world_size` copies of this command; exits with the job's outcome.
    `stop_timeout_s`: how long torchrun lets its ranks stop after a signal before it kills them (its own
    default, 30 s, is shorter than a stopping site needs); an operator's TORCH_ELASTIC_SHUTDOWN_TIMEOUT wins."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.setdefault(SHUTDOWN_TIMEOUT_ENV, str(int(stop_timeout_s)))
    argv = ["--standalone", f"--nproc-per-node={world_size}", "-m", "dilocox.common.cli", *sys.argv[1:]]
    try:
        torchrun(argv)
    except SignalException as stop:
        log.warning("site_stopped", signal=stop.sigval.name, ranks=world_size)
        raise SystemExit(128 + int(stop.sigval)) from None
    except ChildFailedError as failed:
        print(str(failed), file=sys.stderr)  # torch's summary of which rank failed and how, without our stack
        codes = [f.exitcode for f in failed.failures.values()]
        raise SystemExit(next((c for c in codes if c > 0), 1)) from None
    raise SystemExit(0)
