"""Stopping a child process the one way this project does: SIGTERM first, so it takes its graceful
path (a shard saves its checkpoint, a worker reports its pending round, dockerd stops its containers),
then SIGKILL if it has not exited within the grace period."""

from __future__ import annotations

import signal
import socket
import subprocess


def stop_gracefully(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM `proc` if it still runs, wait up to `grace_s`, then kill it; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def free_local_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick), for a process group or server started next."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
