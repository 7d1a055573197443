"""The shard's gRPC methods on `grpc.aio`: a waiting pull is parked on the event loop, not on a thread.

Why: with the thread-pool server every long-polling pull held one of its 32 threads for the
whole round, so a 33rd puller queued — and so did the pushes that would have closed the round: 48
clusters took 10 s a round, 64 took 60 s, every round waiting out a pull's timeout. Pullers are ranks,
not sites, so three sites of 16 ranks were enough. Here a pull that waits for a version awaits an
`asyncio.Event` the shard sets on every publish (and on close), and holds nothing else; only work runs
on the bounded thread pool: a push's decode and commit, a pull's framing of each chunk, a join. A push
thus never queues behind waiting pulls, and the number of pullers is bounded by sockets, not threads.
Status, Provenance and Readmit run on two threads of their own, never queued behind a round's pushes.

The work itself is the thread-pool servicer's own code (`servicer.py`), called from pool threads: one
set of rules for parsing, refusing and streaming. Its `context.abort` becomes an exception that the
async method turns into the call's status; a push's request stream is read on the event loop, whole,
before its work goes to the pool (server/serving/push_intake.py). gRPC's asyncio server ends a
request stream cut by an over-size message as if it were complete (it merges a failed read with the end
of the stream), so every push header declares how many chunks follow, and a push that ends before them
is refused whole (servicer.py).

`latency_s`: user-space WAN latency, every push and pull waits that long (on the loop) before it is
served. This kernel has no `netem`, so tests and benchmarks put a slow link between clusters and shards
on one machine this way (`dilocox server --added-latency-ms`); bandwidth limits still come from `tc`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from dilocox.common.wire.errors import DilocoxError, NotReady, UnknownCodec
from dilocox.common.wire.framing import wire_bytes
from dilocox.common.wire.replica_digest import DIGESTS
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.server.serving.push_intake import PushIntake, PushLimits
from dilocox.server.serving.servicer import AggregatorServicer, refuse

log = structlog.get_logger()
_END = object()
# A pull's chunks are taken from the pool up to this many bytes at a time: small pulls (an observer's
# weights, a round's few contributions) cost one hop to the pool instead of one per chunk plus one for
# the end, and a pull in flight holds at most this much more than one chunk.
PULL_BATCH_BYTES = 256 * 1024


def _take_chunks(chunks, limit: int) -> tuple[list[bytes], bool]:  # noqa: ANN001
    """(On a pool thread.) The next chunks of a pull, until `limit` bytes are taken or it ends, and whether it
    has ended: the hop that takes its last chunks also runs its end (its byte count), so no further hop is
    spent to learn it, nor one to close it."""
    taken, size = [], 0
    while size < limit:
        chunk = next(chunks, _END)
        if chunk is _END:
            return taken, True
        taken.append(chunk)
        size += len(chunk)
    return taken, False


class _Handlers:
    """Takes the generated code's method handlers instead of a server, so that one can be changed."""

    def add_generic_rpc_handlers(self, handlers) -> None:  # noqa: ANN001
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer(servicer: AsyncAggregatorServicer, server: grpc.aio.Server) -> None:
    """The generated `add_AggregatorServicer_to_server`, but Pull sends the bytes its stream yields as they
    are: a version's chunks are serialized once for every pull of them (server/serving/pull_framing.py)."""
    taken = _Handlers()
    pb_grpc.add_AggregatorServicer_to_server(servicer, taken)
    handlers = taken.handlers
    handlers["Pull"] = handlers["Pull"]._replace(response_serializer=wire_bytes)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(taken.service, handlers),))
    server.add_registered_method_handlers(taken.service, handlers)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _ThreadContext:
    """What the thread-pool servicer's code uses of its context, for a call served from a pool thread."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class VersionSignal:
    """Wakes every parked pull when the shard publishes or closes (set from any thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()

    def notify(self) -> None:
        self.loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        event, self.event = self.event, asyncio.Event()
        event.set()


class AsyncAggregatorServicer(pb_grpc.AggregatorServicer):
    def __init__(
        self,
        servicer: AggregatorServicer,
        pool: ThreadPoolExecutor,
        loop: asyncio.AbstractEventLoop,
        latency_s: float = 0.0,
        push_limits: PushLimits | None = None,
    ) -> None:
        self.servicer, self.shard, self.pool, self.loop = servicer, servicer.shard, pool, loop
        # Status, Provenance and Readmit on threads of their own: the work pool is FIFO, so behind a round's
        # pushes (256 sites land at once) a Status waited for every one of them — over a second at 256 sites.
        self.control = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"shard-{self.shard.shard_index}-control")
        self.intake = PushIntake(push_limits or PushLimits(), self.shard.shard_index)
        self.latency_s = latency_s
        self.signal = VersionSignal(loop)
        self.shard.version_listeners.append(self.signal.notify)

    async def _in_pool(self, fn: Callable, *args, pool: ThreadPoolExecutor | None = None):  # noqa: ANN202
        return await self.loop.run_in_executor(pool or self.pool, functools.partial(fn, *args))

    async def _served(
        self,
        method: Callable,
        request,
        context: grpc.aio.ServicerContext,  # noqa: ANN001, ANN202
        pool: ThreadPoolExecutor | None = None,
    ):
        try:
            return await self._in_pool(method, request, _ThreadContext(), pool=pool)
        except _Aborted as aborted:
            await context.abort(aborted.code, aborted.details)

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        return await self._served(self.servicer.Join, request, context)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return await self._served(self.servicer.Status, request, context, self.control)

    async def Provenance(self, request: pb.ProvenanceRequest, context: grpc.aio.ServicerContext) -> pb.ProvenanceReply:
        return await self._served(self.servicer.Provenance, request, context, self.control)

    async def Readmit(self, request: pb.ReadmitRequest, context: grpc.aio.ServicerContext) -> pb.ReadmitReply:
        return await self._served(self.servicer.Readmit, request, context, self.control)

    async def Push(
        self, request_iterator: AsyncIterator[pb.PushMessage], context: grpc.aio.ServicerContext
    ) -> pb.PushReply:
        """Read on the loop (server/serving/push_intake.py), then the servicer's Push on a pool thread over the
        messages received: no pool thread waits on the network."""
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        cluster = None
        try:
            first = await self.intake.header(request_iterator)
            header = first.header
            self.intake.admit(header.cluster)
            cluster = header.cluster
            # Refused before its chunks are read: a push for a closed round costs the shard no memory.
            await self._in_pool(
                self.shard.check_push, header.run_id, header.cluster, header.round, header.weight, header.staleness
            )
            messages = await self.intake.rest(request_iterator, first)
            return await self._served(self.servicer.Push, iter(messages), context)
        except DilocoxError as error:
            await self._refused(error, context)
        finally:
            if cluster is not None:
                self.intake.release(cluster)

    async def _refused(self, error: DilocoxError, context: grpc.aio.ServicerContext) -> None:
        try:
            refuse(_ThreadContext(), error)
        except _Aborted as aborted:
            await context.abort(aborted.code, aborted.details)

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """Serialized TensorChunks, sent as they are (`add_servicer` registers Pull so)."""
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        try:
            found = await self._parked_until_published(request)
        except DilocoxError as error:
            await self._refused(error, context)
        snapshot, chunks, (batch, ended) = found
        try:
            while True:
                for chunk in batch:
                    yield chunk
                if ended:
                    break
                batch, ended = await self._in_pool(_take_chunks, chunks, PULL_BATCH_BYTES)
        finally:  # also when the client goes away mid-stream
            if not ended:
                await self._in_pool(chunks.close)
            self.shard.release(snapshot)

    def _look(self, request: pb.PullRequest):  # noqa: ANN202
        """The snapshot a parked pull waits for, held, with its chunk stream and the first chunks taken (one
        hop to the pool for a pull that fits a batch), or None while it is not published: a plain result, not
        NotReady through the pool's future (every parked pull looks again at every publish, and with
        hundreds parked the exceptions' path was a visible share of the loop's CPU)."""
        try:
            snapshot = self.shard.wait_for_version(
                request.run_id, request.cluster, request.min_version, 0.0, request.observer, hold=True
            )
        except NotReady:
            return None
        chunks = self.servicer.stream(snapshot, request)
        try:
            return snapshot, chunks, _take_chunks(chunks, PULL_BATCH_BYTES)
        except BaseException:
            chunks.close()
            self.shard.release(snapshot)
            raise

    async def _looked(self, look: Callable):  # noqa: ANN202
        """`look` run on the pool; if this pull is cancelled (its client gone) while it runs, what it took —
        a held snapshot and its stream — is given back when it ends rather than held for good."""
        future = self.loop.run_in_executor(self.pool, look)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._give_back)
            raise

    def _give_back(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None or future.result() is None:
            return
        snapshot, chunks, _ = future.result()
        chunks.close()
        self.shard.release(snapshot)

    async def _parked_until_published(self, request: pb.PullRequest):  # noqa: ANN202
        """What `_look` finds for at least `min_version`, waiting on the loop for it: each look at the shard
        is a pool task (it takes the shard's lock, which a closing round holds)."""
        if request.replay_digest not in DIGESTS:  # refused before any wait: nothing to stream it with
            raise UnknownCodec(
                f"state digest {request.replay_digest!r} is not one this shard computes "
                f"({sorted(d or 'sha256 (empty)' for d in DIGESTS)})"
            )
        wait = max(0.0, min(request.wait_seconds, 3600.0))
        deadline = self.loop.time() + wait
        look = functools.partial(self._look, request)
        while True:
            event = self.signal.event  # before looking: a publish after the look still wakes us
            found = await self._looked(look)
            if found is not None:
                return found
            remaining = deadline - self.loop.time()
            if remaining <= 0:
                raise NotReady(
                    f"shard {self.shard.shard_index} holds version {self.shard.version}, not "
                    f"{request.min_version}, after waiting {wait:.1f}s"
                )
            try:
                await asyncio.wait_for(event.wait(), timeout=remaining)
            except TimeoutError:
                pass
