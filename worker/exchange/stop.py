"""A graceful stop on SIGTERM: noted by the signal handler, acted on by the round loop between steps.

A launcher's SIGTERM (Slurm's cancel, a Kubernetes eviction, `docker stop`) used to raise SystemExit at
whatever bytecode the main thread was on — inside the boundary, between collecting round t's exchange
and committing its checkpoint, or inside a lock — and a site once exited 4.6 s after the signal with its
staged round's checkpoint written but never committed, and no line saying so. Now the handler only
records the signal (a Python signal handler runs on the main thread between two bytecodes, so it must
neither log nor take a lock); the round loop looks at it between inner steps, its ranks agree on it
(they must all stop at the same step: their collectives pair up), logs it, and leaves the loop; the
site's `close()` then lets the exchange in flight finish (bounded) and commits the checkpoint staged for
its round, or says why not. The round being trained is not pushed: a resume trains it again from the
last committed round, which the shards have.

A second SIGTERM while the first is being honoured (a boundary waiting for unreachable shards, say)
exits at once, as before.
"""

from __future__ import annotations

import signal
import sys
import threading

FORCED_EXIT = 143  # 128 + SIGTERM, what a shell reports for a process the signal ended


class StopSignal:
    """Installed once per process, on its main thread (`install`); `requested` says whether a stop came."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    @property
    def requested(self) -> bool:
        return bool(self.signals)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signals[0]).name if self.signals else None

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signals:  # asked twice: stop now
            sys.exit(FORCED_EXIT)
        self.signals.append(signum)

    def install(self, *signums: int) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in signums or (signal.SIGTERM,):
                signal.signal(signum, self._on_signal)
        return self
