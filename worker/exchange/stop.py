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

A stop that comes while the boundary waits for the exchange in flight (a round's result held up by a
paused peer, a shard that is down) is not left to that wait, which may last the pull wait (an hour): the
wait looks at the signal twice a second and gives the exchange `STOP_GRACE_S` more, then the site's
ranks agree to leave (`StopDuringExchange`); a round whose push reached the shards is committed even
without its result. SIGINT (Ctrl-C) stops as SIGTERM does. A second signal while the first is being
honoured exits at once — `os._exit`, which no thread still waiting on a shard can hold up.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dilocox.worker.exchange.communicator import Communicator, RoundExchange

FORCED_EXIT = 143  # 128 + SIGTERM, what a shell reports for a process the signal ended
STOP_GRACE_S = 30.0  # what the exchange in flight still gets once a stop is asked for
_POLL_S = 0.5


class StopDuringExchange(Exception):
    """Raised on every rank of a site once they agree that a stop came while the boundary waited for an
    exchange: the run loop leaves as it does between steps."""


class StopSignal:
    """Installed once per process, on its main thread (`install`); `requested` says whether a stop came."""

    def __init__(self, grace_s: float = STOP_GRACE_S) -> None:
        """`grace_s`: how long the exchange in flight still gets once a stop is asked for."""
        self.signals: list[int] = []
        self.grace_s = grace_s

    @property
    def requested(self) -> bool:
        return bool(self.signals)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signals[0]).name if self.signals else None

    @property
    def exit_code(self) -> int:
        """128 + the first signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports it."""
        return 128 + self.signals[0] if self.signals else FORCED_EXIT

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signals:  # asked twice: stop now, whatever thread still waits (sys.exit would wait for them)
            os.write(
                2,
                f"second {signal.Signals(signum).name}: exiting now, without waiting for the exchange in "
                "flight\n".encode(),
            )
            os._exit(128 + signum)
        self.signals.append(signum)

    def install(self, *signums: int) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in signums or (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._on_signal)
        return self


def wait_exchange(communicator: Communicator, stop: StopSignal | None, log) -> tuple[RoundExchange, float] | None:  # noqa: ANN001
    """Collect the exchange in flight (`communicator.collect`); with `stop`, look at it every half second,
    and once a stop is asked for give the exchange `stop.grace_s` more: None if it has not finished by then
    (the caller's ranks agree to leave). A wait longer than one look logs `round_result_waiting` once: the
    site is idle until the round's result comes. Errors of the exchange are raised as `collect` raises them."""
    if stop is None:
        return communicator.collect()
    grace_s = stop.grace_s
    started, asked, said = time.perf_counter(), None, False
    while True:
        try:
            exchange, _ = communicator.collect(timeout=_POLL_S)
            return exchange, time.perf_counter() - started
        except FutureTimeout:
            pass
        if not said:  # once per boundary, and only where it waits: an operator (or a test) sees the site idle here
            said = True
            log.info("round_result_waiting", round=communicator.in_flight, waited_s=_POLL_S)
        if stop.requested and asked is None:
            asked = time.monotonic()
            log.warning(
                "worker_stop_waiting",
                signal=stop.name,
                round=communicator.in_flight,
                grace_s=grace_s,
                reason="a stop came while this rank waited for the round's result: it gets this long more",
            )
        if asked is not None and time.monotonic() - asked >= grace_s:
            return None
