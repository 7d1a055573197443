"""Waiting out an unreachable shard: a restart, a link down, a shard stopping.

A site must survive a shard outage of any length up to `--shard-wait-s` (30 min by default) and go on
the moment the shard serves again. Two things make the difference to sleeping blind between retries:
gRPC's own reconnect backoff is capped (it grows to 120 s by default, so a shard back after a long
outage would stay unreached for up to that long), and the wait watches the channel's state, so the
call is repeated as soon as the channel connects.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc
import structlog

from dilocox.common.security import explain_hostname_mismatch, is_hostname_mismatch
from dilocox.proto import dilocox_pb2 as pb

log = structlog.get_logger()

T = TypeVar("T")

# Capped at 0.5 s (±20 % jitter), a channel notices a restarted shard within ~0.6 s; a refused TCP
# connect every half second costs nothing.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_STOPPING_PAUSE_S = 0.2  # between answers of a shard that is stopping on a live connection
# A shard that stops mid-call answers UNAVAILABLE, or resets the stream, which the client sees as
# CANCELLED (this client never cancels a call itself: its own limits end calls as DEADLINE_EXCEEDED).
WAITED_FOR = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_LOG_EVERY_S = 5.0  # longest wait for the channel between two attempts (one log line each)


class AggregatorError(RuntimeError):
    """A shard refused or failed a call; carries the gRPC status code."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details
        self.bytes_sent = 0  # a push refused by some shards: the bytes the others accepted (AggregatorClient.push)


def call_waiting(
    fn: Callable[[], T],
    address: str,
    channel: grpc.Channel,
    wait_s: float,
    on_reconnect: Callable[[], None] | None = None,
    call: str = "call",
    waited_for: tuple[grpc.StatusCode, ...] = WAITED_FOR,
    closed: Callable[[], bool] = lambda: False,
) -> T:
    """Run `fn` (an idempotent call); while the shard is unreachable (UNAVAILABLE, or CANCELLED by a shard
    that stopped mid-call), wait for `channel` to connect and call again, for up to `wait_s` seconds in
    all. One log line per attempt says how long it has been and how long is left. `on_reconnect` runs after the channel
    connected again, before the next call
    (e.g. to re-send what a restarted shard has lost). Any other status, a certificate that does not
    name the host, or the end of the wait raises `AggregatorError`. `call` names the call in logs;
    `waited_for`: the codes waited out (a push adds DEADLINE_EXCEEDED: its reply lost, it is retried);
    `closed`: once true, a failure is raised at once (the client closed its channels under the call)."""
    started = time.monotonic()
    deadline = started + wait_s
    attempt = 0
    while True:
        try:
            result = fn()
            if attempt:
                log.info(
                    "shard_back",
                    address=address,
                    call=call,
                    attempts=attempt,
                    waited_s=round(time.monotonic() - started, 2),
                )
            return result
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE and is_hostname_mismatch(details):  # no retry fixes a certificate
                raise AggregatorError(address, code, f"{explain_hostname_mismatch(address)} [{details}]") from None
            now = time.monotonic()
            if closed():  # the client was closed under the call (an exchange abandoned at a stop): no waiting
                raise AggregatorError(address, code, f"{details} (the client closed: not waited for)") from None
            if code not in waited_for or now >= deadline:
                if code in waited_for and attempt:
                    details = f"{details} (gave up after waiting {now - started:.0f}s, --shard-wait-s {wait_s:g})"
                raise AggregatorError(address, code, details) from None
        attempt += 1
        log.warning(
            "shard_unavailable_waiting",
            address=address,
            call=call,
            attempt=attempt,
            waited_s=round(now - started, 1),
            gives_up_in_s=round(deadline - now),
            code=code.name,
            reason=details[:200],
        )
        # A stopping shard answers UNAVAILABLE on a live connection: a short pause, so that such answers
        # are not hammered; then wait for the channel to be connected.
        time.sleep(min(_STOPPING_PAUSE_S, max(0.0, deadline - time.monotonic())))
        if wait_connected(channel, min(_LOG_EVERY_S, deadline - time.monotonic())) and on_reconnect is not None:
            on_reconnect()


def wait_connected(channel: grpc.Channel, timeout: float) -> bool:
    """Block until `channel` is connected (True) or `timeout` seconds pass (False)."""
    if timeout <= 0:
        return False
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False


def why_unreachable(stub, error: AggregatorError) -> AggregatorError:
    """A first connection that waited out its deadline says only that; one fail-fast call gets the
    channel's last transport error (refused, a TLS failure, a host-name mismatch) into the message."""
    try:
        stub.Status(pb.StatusRequest(), timeout=5)
        return error
    except grpc.RpcError as probe:
        details = probe.details() or ""
    if is_hostname_mismatch(details):
        return AggregatorError(
            error.address, grpc.StatusCode.UNAVAILABLE, f"{explain_hostname_mismatch(error.address)} [{details}]"
        )
    return AggregatorError(error.address, error.code, f"{error.details}; last connection error: {details}")


FIRST_CONTACT_SAY_EVERY_S = 5.0


@contextlib.contextmanager
def said_while_unreached(
    cluster: str, address: str, gives_up_after_s: float, every_s: float = FIRST_CONTACT_SAY_EVERY_S
) -> Iterator[None]:
    """Around a first call that waits for a shard to be reachable: every `every_s` seconds until the call
    returns, a warning naming the address and how long is left — a mistyped host or a closed port must not
    look like a run that is merely slow to start (it was silent for the whole connect timeout, 60 s)."""
    done = threading.Event()

    def say() -> None:
        started = time.monotonic()
        while not done.wait(every_s):
            waited = time.monotonic() - started
            log.warning(
                "shard_not_reached_yet",
                cluster=cluster,
                address=address,
                waited_s=round(waited, 1),
                gives_up_in_s=round(max(0.0, gives_up_after_s - waited), 1),
                hint="check the address (host, port), the shard's state, and firewalls between them",
            )

    sayer = threading.Thread(target=say, name="shard-first-contact", daemon=True)
    sayer.start()
    try:
        yield
    finally:
        done.set()
        sayer.join(timeout=1)
