"""Measure the bulk TCP rate of a link: a sink that counts bytes, a sender that streams for a while.

Why a probe of our own: the checks of a shaped link (compose simulation, WAN benchmark) must report
the rate they actually got, from inside the same containers/namespaces the training uses, with
nothing installed beyond the project itself (no iperf in the images).

The rate is taken at the receiver over the steady part of the transfer (after the first
`warmup_s`), so the token bucket's initial burst does not inflate it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

BLOCK = 64 * 1024
REPORT_PREFIX = b"RATE "


@dataclass(frozen=True)
class ProbeResult:
    bytes_measured: int  # after the warm-up: what the rate is computed from
    seconds: float
    bytes_total: int = 0  # everything received

    @property
    def mbit_per_s(self) -> float:
        return self.bytes_measured * 8 / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 4), "mbit_per_s": round(self.mbit_per_s, 3)}

    def as_json(self) -> str:
        return json.dumps(self.as_dict())


def receive_counted(
    conn: socket.socket, warmup_s: float, on_first_byte: Callable[[], None] | None = None
) -> ProbeResult:
    """Read until the sender closes its side; count only bytes after the warm-up. `on_first_byte`
    tells a prober watching other counters (e.g. the kernel's) that data flows."""
    start = time.monotonic()
    total, counted, counted_since = 0, 0, None
    while data := conn.recv(BLOCK):
        now = time.monotonic()
        if total == 0 and on_first_byte is not None:
            on_first_byte()
        total += len(data)
        if now - start >= warmup_s:
            if counted_since is None:
                counted_since = now
            else:
                counted += len(data)
    last = time.monotonic()
    return ProbeResult(counted, (last - counted_since) if counted_since is not None else 0.0, total)


def stream_zeros(conn: socket.socket, seconds: float, max_bytes: int = 0) -> None:
    """Send as fast as the link takes it for `seconds`, or until `max_bytes` are sent (0: no cap)."""
    payload = bytes(min(BLOCK, max_bytes) if max_bytes > 0 else BLOCK)
    end, sent = time.monotonic() + seconds, 0
    while time.monotonic() < end and (max_bytes <= 0 or sent < max_bytes):
        conn.sendall(payload)
        sent += len(payload)


def serve_sink(
    server: socket.socket, connections: int = 1, warmup_s: float = 1.0, timeout_s: float = 300.0
) -> list[ProbeResult]:
    """Accept `connections` probes on a listening socket one after another; answer each with its rate."""
    results = []
    with server:
        server.settimeout(timeout_s)
        for _ in range(connections):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout_s)
                result = receive_counted(conn, warmup_s)
                conn.sendall(REPORT_PREFIX + result.as_json().encode() + b"\n")
                results.append(result)
    return results


def send_probe(host: str, port: int, seconds: float, timeout_s: float = 60.0) -> ProbeResult:
    """Stream zeros for `seconds`, half-close, and return the rate the sink measured."""
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        stream_zeros(conn, seconds)
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := conn.recv(4096):
            reply += chunk
    if not reply.startswith(REPORT_PREFIX):
        raise ConnectionError(f"the sink at {host}:{port} sent no rate report")
    fields = json.loads(reply[len(REPORT_PREFIX) :])
    return ProbeResult(fields["bytes_measured"], fields["seconds"], fields["bytes_total"])


def sink_in_thread(host: str = "127.0.0.1", warmup_s: float = 1.0) -> tuple[int, threading.Thread, list[ProbeResult]]:
    """A one-shot sink on a free port, listening before this returns: (port, thread, results when done)."""
    results: list[ProbeResult] = []
    server = socket.create_server((host, 0))
    thread = threading.Thread(target=lambda: results.extend(serve_sink(server, 1, warmup_s, 60)), daemon=True)
    thread.start()
    return server.getsockname()[1], thread, results
