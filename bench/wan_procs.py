"""Child processes of the WAN benchmark: started (possibly inside a namespace), logged, their JSON events
timestamped on arrival, and always stopped — SIGTERM, then SIGKILL — whatever happens to the run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from dilocox.common.subprocesses import stop_gracefully

EventHandler = Callable[[str, dict, float], None]  # (process name, event, monotonic time of arrival)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def dilocox_cli(*args: str) -> list[str]:
    return python_module("dilocox.common.cli", *args)


def child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """One compute thread per process unless told otherwise: the benchmark shares a few cores fairly."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


class ChildProcess:
    """A process whose stderr is teed to `log_path`; JSON lines on it go to `on_event` as they arrive."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: pathlib.Path,
        on_event: EventHandler | None = None,
        env: dict[str, str] | None = None,
        capture_stdout: bool = False,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.on_event = on_event
        self.stdout_text = ""
        self._capture = capture_stdout
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env or child_env(),
        )
        self._reader = threading.Thread(target=self._read, name=f"log-{name}", daemon=True)
        self._reader.start()
        self._out_reader = threading.Thread(target=self._read_stdout, daemon=True) if capture_stdout else None
        if self._out_reader:
            self._out_reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with self.log_path.open("w") as out:
            out.write("$ " + " ".join(self.argv) + "\n")
            for line in self.proc.stderr:
                arrived = time.monotonic()
                out.write(line)
                out.flush()
                if self.on_event is None or not line.startswith("{"):
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(event, dict):
                    self.on_event(self.name, event, arrived)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self.stdout_text = self.proc.stdout.read()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        if self._out_reader:
            self._out_reader.join(timeout=5)
        return code

    def stop(self, grace_s: float = 10.0) -> None:
        stop_gracefully(self.proc, grace_s)
        self._reader.join(timeout=5)

    def tail(self, lines: int = 15) -> str:
        try:
            return "".join(self.log_path.read_text().splitlines(keepends=True)[-lines:])
        except OSError:
            return ""


def stop_all(procs: list[ChildProcess]) -> None:
    """SIGTERM to all first (they shut down in parallel), then wait for each, SIGKILL on a hang."""
    for p in procs:
        if p.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()


def wait_for_file(path: pathlib.Path, owner: ChildProcess, timeout_s: float = 60.0) -> str:
    """Wait for a child to write `path` (a port file); fail with its log tail if it dies first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if owner.poll() is not None:
            raise RuntimeError(f"{owner.name} exited with {owner.poll()} before writing {path.name}:\n{owner.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{owner.name} did not write {path.name} within {timeout_s:.0f}s:\n{owner.tail()}")
        time.sleep(0.05)
    return path.read_text().strip()


def wait_all(procs: list[ChildProcess], deadline: float, what: str) -> None:
    """Wait for every process to exit 0 before `deadline` (monotonic); the first failure raises with its log."""
    pending = list(procs)
    while pending:
        for p in list(pending):
            code = p.poll()
            if code is None:
                continue
            pending.remove(p)
            p.wait()
            if code != 0:
                raise RuntimeError(f"{what}: {p.name} exited with {code}; log {p.log_path}:\n{p.tail()}")
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {', '.join(p.name for p in pending)} still running at the time limit")
        time.sleep(0.1)
