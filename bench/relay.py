"""A user-space WAN for TCP streams: a relay that delays (and, if asked, throttles) what it forwards.

This kernel has no `netem`, so link latency cannot come from `tc`. The relay sits between the clusters
and the shards: every chunk it reads is delivered `latency ± jitter` later (in order, so the stream is
never reordered), per direction. With a rate it also meters each direction through a token bucket shared
by all connections of the same link — the in-process fallback when network namespaces are unavailable.

Run as `python -m dilocox.bench.relay SPEC.json` where the spec is
    {"links": {"s0": {"rate_mbit": 20.0 | null, "latency_ms": 2.0, "jitter_ms": 0.5}, …},
     "routes": [{"listen": ["0.0.0.0", 0], "upstream": ["127.0.0.1", 5000], "link": "s0"}, …],
     "ports_file": "…", "stats_file": "…"}
It writes the bound ports (one per route, in order) to ports_file once listening, and the bytes it
forwarded per link and direction to stats_file every second and on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import signal
import sys
import time
from dataclasses import dataclass

from dilocox.common.atomic_file import write_text_atomic

CHUNK = 64 * 1024


@dataclass(frozen=True)
class LinkSpec:
    rate_mbit: float | None = None  # None: no throttle here (tc shapes the link, or nothing does)
    latency_ms: float = 0.0  # one way
    jitter_ms: float = 0.0  # uniform in ±jitter, clipped at 0

    def delay_s(self, rng: random.Random) -> float:
        jitter = rng.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms > 0 else 0.0
        return max(0.0, self.latency_ms + jitter) / 1000


class TokenBucket:
    """`rate` bytes/s with a burst of ~10 ms (at least one chunk); `take` waits until the bytes may pass."""

    def __init__(self, rate_bytes_s: float) -> None:
        self.rate = rate_bytes_s
        self.capacity = max(float(CHUNK), rate_bytes_s * 0.01)
        self.tokens = self.capacity
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:  # first come, first served between the link's connections
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class Link:
    def __init__(self, name: str, spec: LinkSpec, seed: int) -> None:
        self.name = name
        self.spec = spec
        self.rng = random.Random(seed)
        rate = spec.rate_mbit * 1e6 / 8 if spec.rate_mbit else None
        self.buckets = {d: TokenBucket(rate) if rate else None for d in ("up", "down")}
        self.bytes = {"up": 0, "down": 0}
        self.connections = 0


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link, direction: str) -> None:
    """Read → (throttle) → hold until due → write, preserving order; half-close at EOF."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=256)

    async def deliver() -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
            link.bytes[direction] += len(data)
        if writer.can_write_eof():
            writer.write_eof()

    delivering = asyncio.create_task(deliver())
    last_due = 0.0
    try:
        while data := await reader.read(CHUNK):
            bucket = link.buckets[direction]
            if bucket is not None:
                await bucket.take(len(data))
            last_due = max(last_due, time.monotonic() + link.spec.delay_s(link.rng))
            await queue.put((last_due, data))
    finally:
        await queue.put(None)
        await delivering


async def _serve(link: Link, upstream: tuple[str, int], client_reader, client_writer) -> None:
    link.connections += 1
    try:
        up_reader, up_writer = await asyncio.open_connection(*upstream)
    except OSError:
        client_writer.close()
        return
    try:
        await asyncio.gather(
            _forward(client_reader, up_writer, link, "up"),
            _forward(up_reader, client_writer, link, "down"),
            return_exceptions=True,
        )
    finally:
        for w in (up_writer, client_writer):
            w.close()


async def main_async(spec: dict) -> None:
    links = {
        name: Link(name, LinkSpec(**params), seed=i) for i, (name, params) in enumerate(sorted(spec["links"].items()))
    }
    servers, ports = [], []
    for route in spec["routes"]:
        link, upstream = links[route["link"]], (route["upstream"][0], int(route["upstream"][1]))
        server = await asyncio.start_server(
            lambda r, w, link=link, up=upstream: _serve(link, up, r, w), route["listen"][0], int(route["listen"][1])
        )
        servers.append(server)
        ports.append(server.sockets[0].getsockname()[1])
    write_text_atomic(spec["ports_file"], json.dumps(ports))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def stats() -> str:
        return json.dumps(
            {
                n: {"bytes": link.bytes, "connections": link.connections, "spec": vars(link.spec)}
                for n, link in links.items()
            }
        )

    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            pass
        if spec.get("stats_file"):
            write_text_atomic(spec["stats_file"], stats())
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(pathlib.Path(argv[0]).read_text())
    asyncio.run(main_async(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
