"""Processes a test run leaves behind: the run's teardown check (tests/conftest.py).

Every process the tests start inherits one environment variable that names the run; at the end of the
run (after every xdist worker has finished) any process still carrying it — a shard, a worker, a
torchrun rank, a relay, a daemon a fixture forgot — is reported by its command line, killed, and fails
the run. Why the environment and not the process tree: a child whose parent died is re-parented to
init and leaves the tree, which is exactly the leftover this check exists for."""

from __future__ import annotations

import os
import signal
import time

MARK = "PYTEST_DILOCOX_RUN"  # not DILOCOX_*: the CLI refuses variables of its own prefix it does not know
EXECNET = "exec(eval(sys.stdin.readline()))"  # an xdist worker's bootstrap: the run's own, gone right after
# multiprocessing's resource tracker, started by a spawn in this very process: it reads a pipe only this
# process holds and ends with it (under xdist its parent is a worker, gone by the check).
RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def mark_this_run() -> str:
    """Name the run in this process's environment (kept where a parent, e.g. xdist's controller, named it)."""
    return os.environ.setdefault(MARK, f"{os.getpid()}-{time.time_ns()}")


def marked_processes(mark: str) -> dict[int, str]:
    """pid -> command line of every live process (other than this one) whose environment carries `mark`."""
    wanted, found = f"{MARK}={mark}".encode(), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            ours = RESOURCE_TRACKER in command and _parent_of(int(entry)) == os.getpid()
        except OSError:  # gone meanwhile, or another user's
            continue
        if (
            command and EXECNET not in command and not ours
        ):  # a zombie has no command line; xdist's workers are the run's own
            found[int(entry)] = command
    return found


def left_behind(mark: str, grace_s: float = 20.0) -> dict[int, str]:
    """The marked processes still alive after `grace_s` (processes ending as the run ends get that long),
    each then killed."""
    deadline = time.monotonic() + grace_s
    while (alive := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return alive
