"""Start a shard's gRPC server: grpc.aio on its own event-loop thread (waiting pulls park on the loop,
server/serving/aio_servicer.py), the health service, TLS and the run token, the round-deadline timer, and a stop
that turns health NOT_SERVING first.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from dilocox.common.config.run import WireConfig
from dilocox.common.security import AsyncTokenInterceptor, TlsFiles, server_credentials
from dilocox.server.serving.aio_servicer import AsyncAggregatorServicer, add_servicer
from dilocox.server.serving.health import add_health_service, mark_serving
from dilocox.server.serving.health_watch import STALL_S, ServingWatch
from dilocox.server.serving.pull_framing import DEFAULT_BUDGET_MB, PullFramings
from dilocox.server.serving.push_intake import PushLimits
from dilocox.server.serving.servicer import AggregatorServicer
from dilocox.server.shard import Shard

log = structlog.get_logger()


class ServerHandle:
    """A `grpc.aio` server on its own event-loop thread, with the blocking API the rest of the project uses
    (`stop(grace)` returning an event to wait on), so that the shard's core, its checkpointer and its
    command stay plain threads."""

    def __init__(
        self,
        server: grpc.aio.Server,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        pool: ThreadPoolExecutor,
        on_stop,
        control: ThreadPoolExecutor | None = None,
    ) -> None:  # noqa: ANN001
        self._server, self._loop, self._thread, self._pool, self._on_stop = server, loop, thread, pool, on_stop
        self._control = control  # the status calls' own threads (server/serving/aio_servicer.py)
        self._stopped: threading.Event | None = None
        self.framings: PullFramings | None = (
            None  # the pulls' shared framings (server/serving/pull_framing.py), for metrics
        )

    def stop(self, grace: float | None) -> threading.Event:
        """Health turns NOT_SERVING, held pulls are answered (UNAVAILABLE), calls in flight get `grace`
        seconds; the returned event is set once the server, its loop and its pool are down."""
        if self._stopped is not None:
            return self._stopped
        self._stopped = done = threading.Event()

        async def shutdown() -> None:
            await self._on_stop()
            await self._server.stop(grace)

        def finish(_future) -> None:  # noqa: ANN001
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            for pool in (self._pool, self._control):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
            done.set()

        future = asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        future.add_done_callback(lambda f: threading.Thread(target=finish, args=(f,), daemon=True).start())
        return done


def default_work_threads() -> int:
    """The CPUs this process may run on, plus 2, at most 32. The pool only computes (decode, vet, commit,
    frame): the push intake reads on the event loop, so a thread never waits on the network and threads
    beyond the cores only hand the interpreter lock around. At 128 sites on 2 cores, 4 threads took 12.3 ms of
    shard CPU per site and round where 32 took 15.3 (docs/performance.md, "At WAN pace")."""
    return min(32, len(os.sched_getaffinity(0)) + 2)


def start_server(
    shard: Shard,
    host: str = "127.0.0.1",
    port: int = 0,
    wire: WireConfig | None = None,
    max_workers: int | None = None,
    added_latency_s: float = 0.0,
    tls: TlsFiles | None = None,
    token: str | None = None,
    push_limits: PushLimits | None = None,
    health_stall_s: float = STALL_S,
    pull_cache_bytes: int = DEFAULT_BUDGET_MB << 20,
) -> tuple[ServerHandle, int]:
    """Start serving `shard`; returns the server and the bound port (useful with port=0).

    `max_workers`: threads for the work of calls (decoding pushes, framing pulls); waiting pulls hold none and
    no thread reads the network (server/serving/aio_servicer.py); None: `default_work_threads()`. `added_latency_s` >
    0 delays every push and pull (user-space WAN latency, see server/serving/aio_servicer.py). `tls`: serve TLS (mTLS
    when it names a CA); `token`: refuse calls without the run's token. `push_limits`: how long a push stream
    may stay silent and how many one cluster may hold open (server/serving/push_intake.py). `health_stall_s`: health
    turns NOT_SERVING while a task has waited this long for a work thread (server/serving/health_watch.py).
    `pull_cache_bytes`: what the chunks framed once for every pull of a version may hold
    (server/serving/pull_framing.py; 0: each pull frames its own).
    """
    wire = wire or WireConfig()
    max_workers = default_work_threads() if max_workers is None else max_workers
    if max_workers < 1:
        raise ValueError(f"--work-threads must be ≥ 1, got {max_workers}")
    if pull_cache_bytes < 0:
        raise ValueError(f"--pull-cache-mb must be ≥ 0, got {pull_cache_bytes >> 20}")
    if health_stall_s <= 0:  # refused before anything listens
        raise ValueError(f"--health-stall-s must be > 0, got {health_stall_s}")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"shard-{shard.shard_index}-grpc", daemon=True)
    thread.start()
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shard-rpc")
    try:
        server, bound, health_service, servicer = asyncio.run_coroutine_threadsafe(
            _serve(shard, host, port, wire, pool, loop, added_latency_s, tls, token, push_limits, pull_cache_bytes),
            loop,
        ).result(timeout=60)
        watch = ServingWatch(health_service, pool, shard.shard_index, health_stall_s)
        watching = asyncio.run_coroutine_threadsafe(_started(watch.run()), loop).result(timeout=60)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        pool.shutdown(wait=False)
        raise
    stop_timer = shard.start_deadline_timer()

    async def on_stop() -> None:  # health turns NOT_SERVING first, held pulls are answered, the deadline timer ends
        await health_service.enter_graceful_shutdown()
        watching.cancel()
        shard.close()
        stop_timer.set()
        shard.version_listeners.remove(servicer.signal.notify)  # the shard may be served again (tests restart one)

    log.info(
        "shard_serving",
        shard=shard.shard_index,
        num_shards=shard.num_shards,
        address=f"{host}:{bound}",
        run_id=shard.run_id,
        tls="mtls" if tls and tls.ca else ("tls" if tls else "plaintext"),
        token=bool(token),
        work_threads=max_workers,
    )
    handle = ServerHandle(server, loop, thread, pool, on_stop, servicer.control)
    handle.framings = servicer.servicer.framings
    return handle, bound


async def _started(coroutine) -> asyncio.Task:  # noqa: ANN001
    return asyncio.create_task(coroutine)


async def _serve(
    shard: Shard,
    host: str,
    port: int,
    wire: WireConfig,
    pool: ThreadPoolExecutor,
    loop: asyncio.AbstractEventLoop,
    added_latency_s: float,
    tls: TlsFiles | None,
    token: str | None,
    push_limits: PushLimits | None,
    pull_cache_bytes: int,
):  # noqa: ANN202
    options = [
        ("grpc.max_receive_message_length", wire.max_message_bytes),
        ("grpc.max_send_message_length", wire.max_message_bytes),
        *wire.keepalive_options(server=True),
    ]
    server = grpc.aio.server(options=options, interceptors=[AsyncTokenInterceptor(token)] if token else None)
    servicer = AsyncAggregatorServicer(
        AggregatorServicer(shard, wire, PullFramings(pull_cache_bytes)), pool, loop, added_latency_s, push_limits
    )
    add_servicer(servicer, server)  # Pull sends its pre-serialized chunks as they are
    health_service = await add_health_service(server)
    bound = (
        server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        if tls is not None
        else server.add_insecure_port(f"{host}:{port}")
    )
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    shard.closing = False  # a shard served again after a stop (tests restart one in-process)
    await server.start()
    await mark_serving(health_service)  # listening, and any resumed state is already restored
    return server, bound, health_service, servicer
