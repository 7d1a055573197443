"""Installing a Debian package a test runs for real (slurm-wlm, prometheus), where this machine allows.

CI starts from a clean machine with nothing installed by hand: a test that needs a real daemon installs
it itself with apt-get when it runs as root, and otherwise raises `PackageUnavailable` with the reason,
which the test turns into a SKIPPED line saying why."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile

LOCK_FILE = os.path.join(tempfile.gettempdir(), "dilocox-tests-apt.lock")


class PackageUnavailable(RuntimeError):
    pass


def _present(programs: tuple[str, ...]) -> bool:
    return all(shutil.which(p) or os.path.exists(f"/usr/sbin/{p}") for p in programs)


def ensure(package: str, programs: tuple[str, ...], timeout: float = 600) -> None:
    """Make `programs` available, installing `package` with apt-get if one is missing."""
    if _present(programs):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PackageUnavailable(f"{package} is not installed and this is not root with apt-get to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Tests run in parallel (pytest-xdist): two installs at once would meet on dpkg's lock, and the loser
    # would skip its test. One install at a time, and apt waits for a lock held by anything else.
    wait = ["-o", f"DPkg::Lock::Timeout={int(timeout)}"]
    command = ["apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", package]
    with open(LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _present(programs):  # installed by the test that held the lock before us
            return
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
        if done.returncode != 0:  # the package lists may be missing on a new machine
            subprocess.run(["apt-get", *wait, "update", "-q"], capture_output=True, timeout=timeout, env=env)
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0 or not _present(programs):
        raise PackageUnavailable(f"apt-get install {package} failed: {(done.stderr or done.stdout).strip()[-300:]}")
