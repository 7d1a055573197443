"""Starting a site: a `dilocox worker --pp P --dp D` that is not under torchrun yet becomes one.

On one machine the worker re-executes itself as a standalone torchrun job of P × D processes. Across
nodes, start torchrun yourself on every node with the same rendezvous (docs/deploy.md); the worker
sees RANK/WORLD_SIZE and joins the job instead.
"""

from __future__ import annotations

import os
import sys


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def relaunch_with_torchrun(world_size: int) -> None:
    """Replace this process with a standalone torchrun job of `world_size` copies of the same command."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "-m", "dilocox.common.cli", *sys.argv[1:]]  # fmt: skip
    os.execv(sys.executable, argv)
