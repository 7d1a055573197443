"""Background communication of one round: push Δ_t, then pull θ_t, off the training thread.

With the one-step delay (DESIGN.md §3) the trainer hands round t's pseudo-gradient here and goes
straight on to round t+1; it collects θ_t at the *next* boundary. gRPC and zstd release the GIL, so
a plain thread overlaps the WAN with compute. At most one round is in flight: `submit` refuses a
second one, so memory and staleness stay bounded to exactly one round.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc
import structlog
import torch

from dilocox.common.config.waits import PULL_WAIT_S
from dilocox.common.wire.framing import SliceKey
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError

log = structlog.get_logger()


@dataclass
class RoundExchange:
    """What one round's communication brought back, and what it cost."""

    round: int
    version: int
    weights: dict[SliceKey, torch.Tensor]
    bytes_up: int
    bytes_down: int
    push_s: float
    pull_s: float
    late: bool = False  # a shard had closed the round without our push: the client carries that part

    @property
    def comm_s(self) -> float:
        return self.push_s + self.pull_s


class Communicator:
    def __init__(
        self,
        client: AggregatorClient,
        pull_names: tuple[str, ...] = (),
        pull_wait_s: float = PULL_WAIT_S,
        repush_after_s: float = 30.0,
    ) -> None:
        """`repush_after_s`: while waiting for the round's result, push again this often (idempotent):
        a shard restarted from a checkpoint has lost the open round's pushes and needs them again."""
        self.client = client
        self.pull_names = pull_names
        self.pull_wait_s = pull_wait_s
        self.repush_after_s = repush_after_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="communicator")
        self._in_flight: tuple[int, Future] | None = None
        self._lock = threading.Lock()
        self._pushed = threading.Event()  # the round in flight has been pushed (or its push failed)
        self._pushed.set()
        self.pushed_round: int | None = None  # the last round whose push every shard took

    @property
    def in_flight(self) -> int | None:
        """The round whose exchange has not been collected yet, if any."""
        return self._in_flight[0] if self._in_flight else None

    def submit(
        self,
        round_: int,
        weight: float,
        slices: dict[SliceKey, torch.Tensor],
        codec: str | None = None,
        facts: tuple[int, float, int] = (0, 0.0, 0),
        formed: bool = False,
    ) -> None:
        """Start pushing round `round_` and pulling its result; `slices` must not change afterwards.
        `codec`: a dense codec for this round's push instead of the compressor's (the end-of-run flush).
        `facts`: (inner steps, idle seconds, staleness) of the round, for the shards (`AggregatorClient.push`).
        `formed`: `slices` hold Δ + e in the compressor's residual buffers (`AggregatorClient.push`)."""
        with self._lock:
            if self._in_flight is not None:
                raise RuntimeError(
                    f"round {self._in_flight[0]} is still in flight; collect it before submitting {round_}"
                )
            self._pushed = threading.Event()
            self._in_flight = (
                round_,
                self._executor.submit(self._exchange, round_, weight, slices, codec, self._pushed, facts, formed),
            )

    @property
    def ready(self) -> bool:
        """Whether the round in flight has come back (or failed): collecting it would not block."""
        pending = self._in_flight
        return pending is not None and pending[1].done()

    def wait_pushed(self) -> None:
        """Return once the round in flight (if any) has been pushed — its compression done, so the
        compressor's state is settled — without waiting for the round's result."""
        self._pushed.wait()

    def collect(self, timeout: float | None = None) -> tuple[RoundExchange, float]:
        """Wait for the in-flight round; returns (its exchange, seconds this call blocked)."""
        with self._lock:
            if self._in_flight is None:
                raise RuntimeError("no round in flight")
            round_, future = self._in_flight
        started = time.perf_counter()
        try:
            result = future.result(timeout=timeout)  # re-raises the exchange's error, if any
        except FutureTimeout:
            raise  # still in flight: the caller may collect again
        except Exception:
            # The exchange itself failed: nothing is in flight any more. (A SystemExit from a signal
            # handler is no Exception: the round stays in flight for close() to finish or abandon.)
            with self._lock:
                self._in_flight = None
            raise
        waited = time.perf_counter() - started
        with self._lock:
            self._in_flight = None
        return result, waited

    def close(self, timeout: float = 30.0) -> str:
        """Finish or abandon what is in flight, never hanging longer than `timeout`.

        Returns "idle" (nothing was in flight), "completed" (the pending round's push and pull finished),
        "pushed" (its push reached every shard but its result did not come in time: the shards have the
        round's part), or "abandoned" (not pushed in time, or failed; the shard never saw a partial push,
        because a push stream only counts once complete).
        """
        outcome = "idle"
        pending = self._in_flight
        if pending is not None:
            round_, future = pending
            try:
                future.result(timeout=timeout)
                outcome = "completed"
            except FutureTimeout:
                outcome = "pushed" if self.pushed_round == round_ else "abandoned"
                log.warning(
                    "pending_round_abandoned",
                    round=round_,
                    pushed=outcome == "pushed",
                    reason=f"not finished within {timeout:.0f}s",
                )
            except Exception as error:  # noqa: BLE001 - reported, then shutdown goes on
                outcome = "abandoned"
                log.warning("pending_round_abandoned", round=round_, reason=str(error))
            else:
                log.info("pending_round_completed", round=round_)
            self._in_flight = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        return outcome

    def _exchange(
        self,
        round_: int,
        weight: float,
        slices: dict[SliceKey, torch.Tensor],
        codec: str | None,
        push_done: threading.Event,
        facts: tuple[int, float, int] = (0, 0.0, 0),
        formed: bool = False,
    ) -> RoundExchange:
        started = time.perf_counter()
        # One end for the whole exchange: no call waits out an unreachable shard past it, and no re-push or
        # pull starts after it, so a rank's exchange ends within shard wait + pull wait (+ one call's own
        # limit) whatever fails when — inside the site's agreement timeout (common/config/waits.py).
        ends = time.monotonic() + self.client.shard_wait_s + self.pull_wait_s
        self.client.outage_deadline = ends
        try:
            return self._push_and_pull(round_, weight, slices, codec, push_done, facts, formed, started, ends)
        finally:
            self.client.outage_deadline = None

    def _push_and_pull(
        self,
        round_: int,
        weight: float,
        slices: dict[SliceKey, torch.Tensor],
        codec: str | None,
        push_done: threading.Event,
        facts: tuple[int, float, int],
        formed: bool,
        started: float,
        ends: float,
    ) -> RoundExchange:
        result = None  # the round's result, when a refused push found it published already
        try:
            bytes_up = self.client.push(round_, weight, slices, codec=codec, facts=facts, formed=formed)
            self.pushed_round = round_
        except AggregatorError as error:
            result = self._closed_without_us(round_) if error.code == grpc.StatusCode.FAILED_PRECONDITION else None
            if result is None:
                raise
            bytes_up = error.bytes_sent  # the shards that still took this round's part (all refused: 0)
        finally:
            push_done.set()
        pushed = time.perf_counter()
        give_up = min(time.monotonic() + self.pull_wait_s, ends)
        if result is not None:
            version, weights, bytes_down = result
            return RoundExchange(round_, version, weights, bytes_up, bytes_down, pushed - started, 0.0, late=True)
        while True:
            wait = max(0.1, min(self.repush_after_s, give_up - time.monotonic()))
            try:
                version, weights, bytes_down = self.client.pull(round_, names=self.pull_names, wait_seconds=wait)
                break
            except AggregatorError as error:
                if error.code != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= give_up:
                    raise
            log.info("round_result_late_repushing", round=round_, waited_s=round(time.perf_counter() - pushed, 1))
            # Refused (FAILED_PRECONDITION): the shard closed the round without us, or went back to an
            # older version, or dropped us — the client keeps that part for the next push, and the error
            # makes the cluster rejoin. (A round closed *with* our push answers the re-push as duplicates.)
            self.client.push(round_, weight, slices, reencode=False)
        return RoundExchange(
            round_, version, weights, bytes_up, bytes_down, pushed - started, time.perf_counter() - pushed
        )

    def _closed_without_us(self, round_: int) -> tuple[int, dict, int] | None:
        """After a refused push: whether the round is published and we are still in the run — a shard
        closed it on a quorum without us (server/rounds/round_close.py). Our part is in the client's carry then,
        and the round's result (returned, as `client.pull` gives it) is what the pull brought. Any other
        refusal (dropped from the run, a shard gone back, the run over) stays the push's error: the site
        rejoins."""
        try:
            # Shards that took our part may still be in their grace window: wait for them a while.
            result = self.client.pull(round_, names=self.pull_names, wait_seconds=max(0.5, self.repush_after_s))
        except AggregatorError:
            return None
        log.warning(
            "round_closed_without_us",
            round=round_,
            version=result[0],
            reason="a shard closed the round on its quorum before our push: it goes with our next push",
        )
        return result
