"""A cluster's stderr, read by the sim: teed into its log file, its JSON events handed on, its last complaint kept.

Its own module because it is a thread of its own with one job, reading one child's stream to its end,
and knows nothing of rounds or summaries: what the events mean is the Simulation's (main.py) business.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import threading


class ClusterLogReader(threading.Thread):
    """Tees a cluster's stderr into its log file and hands its JSON events to `on_event`; remembers the
    last thing the cluster said was wrong (`reason`), for the summary when it fails."""

    def __init__(self, name: str, proc: subprocess.Popen, log_path: pathlib.Path, on_event) -> None:
        super().__init__(daemon=True, name=f"log-{name}")
        self.cluster = name
        self.proc = proc
        self.log_path = log_path
        self.on_event = on_event
        self._error_event: str | None = None  # its last error-level log event
        self._last_text: str | None = None  # its last plain line: a SystemExit message, a traceback's last line

    def run(self) -> None:
        assert self.proc.stderr is not None
        with self.log_path.open("w") as out:
            for line in self.proc.stderr:
                out.write(line)
                out.flush()
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    if line.strip():
                        self._last_text = line.strip()
                    continue
                if isinstance(event, dict):
                    if event.get("level") in ("error", "critical"):
                        details = {k: v for k, v in event.items() if k not in ("event", "level", "timestamp", "logger")}
                        self._error_event = f"{event.get('event')}: " + ", ".join(
                            f"{k}={v}" for k, v in details.items()
                        )
                    self.on_event(self.cluster, event)

    def reason(self) -> str:
        """Why the cluster failed, as it said last (call after it exited and its stderr is read)."""
        self.join(timeout=5)
        return self._error_event or self._last_text or "it exited without saying why"
