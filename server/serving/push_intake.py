"""A push's request stream, read on the event loop: no thread waits on the network.

Why: the shard's work pool (32 threads) served joins, status, pull framing and pushes, and a
push's stream was read by a pool thread blocking on each next message. Push streams that sent a header
and a chunk and then stayed silent (the client alive, answering keepalives: a stalled NAT, a half-closed
proxy, a hostile site) each held a thread for good: with 32 of them no round closed and `Status`, joins
and pulls timed out. Honest traffic bound the same way: more than 32 pushes in transit over slow links.

Here the messages are awaited on the loop, each within `idle_timeout_s` (a stream silent longer is
refused UNAVAILABLE, nothing of it applied), and the pool gets the work only once the whole push is in:
the header's check, then decode, vet and commit, as before (`servicer.py`). A cluster identity may hold
at most `streams_per_cluster` push streams at a shard at once (RESOURCE_EXHAUSTED past it): a site
pushes one stream per rank and shard, so the bound is well above any layout and well below what would
exhaust the shard's memory or sockets. The push's messages are held until its last arrives: a push's
compressed bytes once more, for as long as the push is in transit.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dilocox.common.wire.errors import InvalidFrame, StreamStalled, TooManyStreams
from dilocox.proto import dilocox_pb2 as pb


@dataclass(frozen=True)
class PushLimits:
    """`idle_timeout_s`: the longest a push stream may send nothing (well above a 4 MB chunk's transfer time
    at 1 Mbit/s, 34 s); `streams_per_cluster`: push streams one cluster identity may hold open at once."""

    idle_timeout_s: float = 300.0
    streams_per_cluster: int = 256

    def __post_init__(self) -> None:
        if self.idle_timeout_s <= 0:
            raise ValueError(f"--push-idle-timeout-s must be > 0, got {self.idle_timeout_s}")
        if self.streams_per_cluster < 1:
            raise ValueError(f"--push-streams-per-cluster must be ≥ 1, got {self.streams_per_cluster}")


class PushIntake:
    """Admits and reads push streams on the loop (one instance per server; loop-thread only)."""

    def __init__(self, limits: PushLimits, shard_index: int) -> None:
        self.limits, self.shard_index = limits, shard_index
        self.open_streams: Counter[str] = Counter()

    async def header(self, stream: AsyncIterator[pb.PushMessage]) -> pb.PushMessage:
        """The push's first message, which must be its header (`InvalidFrame` otherwise)."""
        first = await self._next(stream, received=0, declared=None)
        if first is None or first.WhichOneof("body") != "header":
            raise InvalidFrame("a push stream must start with a PushHeader")
        return first

    async def rest(self, stream: AsyncIterator[pb.PushMessage], first: pb.PushMessage) -> list[pb.PushMessage]:
        """The whole push: its header and the chunk messages it declares, plus one more if sent (so the
        servicer refuses the excess by its rule); `StreamStalled` when a message is slower than the idle
        timeout. A stream that ends early is the servicer's to refuse (it counts the chunks)."""
        messages, declared = [first], first.header.chunks
        while len(messages) <= declared + 1:
            message = await self._next(stream, received=len(messages) - 1, declared=declared)
            if message is None:
                break
            messages.append(message)
        return messages

    def admit(self, cluster: str) -> None:
        if self.open_streams[cluster] >= self.limits.streams_per_cluster:
            raise TooManyStreams(
                f"cluster {cluster!r} already has {self.open_streams[cluster]} push streams open at shard "
                f"{self.shard_index} (--push-streams-per-cluster {self.limits.streams_per_cluster})"
            )
        self.open_streams[cluster] += 1

    def release(self, cluster: str) -> None:
        self.open_streams[cluster] -= 1
        if self.open_streams[cluster] <= 0:
            del self.open_streams[cluster]

    async def _next(
        self, stream: AsyncIterator[pb.PushMessage], received: int, declared: int | None
    ) -> pb.PushMessage | None:
        try:  # asyncio.timeout, not wait_for: no task created per message on the loop
            async with asyncio.timeout(self.limits.idle_timeout_s):
                return await anext(stream)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            where = (
                "before its header"
                if declared is None
                else f"after {received} of the {declared} chunk messages its header declared"
            )
            raise StreamStalled(
                f"the push stream sent nothing for {self.limits.idle_timeout_s:g}s {where} "
                "(--push-idle-timeout-s); nothing of it was applied: push again"
            ) from None
