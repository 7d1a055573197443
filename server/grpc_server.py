"""Start a shard's gRPC server: the aggregator servicer (with user-space latency if asked), the health
service, TLS and the run token, the round-deadline timer, and a stop that turns health NOT_SERVING first.

Apart from `servicer.py` so that the servicer and its latency variant (`latency.py`) sit below the one
module that chooses between them.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import structlog

from dilocox.common.config.run import WireConfig
from dilocox.common.security import TlsFiles, TokenInterceptor, server_credentials
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.server.health import add_health_service, mark_serving, mark_shutting_down
from dilocox.server.latency import LatencyServicer
from dilocox.server.servicer import AggregatorServicer
from dilocox.server.shard import Shard

log = structlog.get_logger()


def _fail_cut_streams() -> None:
    """Make a request stream that gRPC cut off (a message over the receive limit) raise, not end.

    gRPC Python ignores a failed receive's `success` flag and ends the request iterator as if the client
    had half-closed (see grpc/grpc#33038), so a push cut by an oversize message looked complete and its
    first slices were committed, even closing the round, while the client got RESOURCE_EXHAUSTED. Marking the call
    cancelled on a failed receive makes the iterator raise instead, and nothing of the push is applied.
    Patches a private hook once per process; a no-op if a grpc release renames it.
    """
    from grpc import _server

    original = getattr(_server, "_receive_message", None)
    if original is None or getattr(original, "fails_cut_streams", False) or not hasattr(_server, "_CANCELLED"):
        return

    def receive_message(state, call, request_deserializer):
        on_event = original(state, call, request_deserializer)

        def receive(event):
            if not event.success:
                with state.condition:
                    state.client = _server._CANCELLED
            return on_event(event)

        return receive

    receive_message.fails_cut_streams = True  # type: ignore[attr-defined]
    _server._receive_message = receive_message


def start_server(
    shard: Shard,
    host: str = "127.0.0.1",
    port: int = 0,
    wire: WireConfig | None = None,
    max_workers: int = 32,
    added_latency_s: float = 0.0,
    tls: TlsFiles | None = None,
    token: str | None = None,
) -> tuple[grpc.Server, int]:
    """Start serving `shard`; returns the server and the bound port (useful with port=0).

    `added_latency_s` > 0 delays every push and pull (user-space WAN latency, see server/latency.py).
    `tls`: serve TLS (mTLS when it names a CA); `token`: refuse calls without the run's token.
    """
    wire = wire or WireConfig()
    _fail_cut_streams()
    options = [
        ("grpc.max_receive_message_length", wire.max_message_bytes),
        ("grpc.max_send_message_length", wire.max_message_bytes),
        *wire.keepalive_options(server=True),
    ]
    interceptors = [TokenInterceptor(token)] if token else None
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shard-rpc"), options=options, interceptors=interceptors
    )
    if added_latency_s > 0:
        servicer: AggregatorServicer = LatencyServicer(shard, added_latency_s, wire)
    else:
        servicer = AggregatorServicer(shard, wire)
    pb_grpc.add_AggregatorServicer_to_server(servicer, server)
    health_service = add_health_service(server)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls))
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    shard.closing = False  # a shard served again after a stop (tests restart one in-process)
    server.start()
    stop_timer = shard.start_deadline_timer()
    mark_serving(health_service)  # listening, and any resumed state is already restored
    server_stop = server.stop

    def stop(grace):  # health turns NOT_SERVING first, held pulls are answered, the deadline timer ends
        mark_shutting_down(health_service)
        shard.close()
        stop_timer.set()
        return server_stop(grace)

    server.stop = stop  # type: ignore[method-assign]
    log.info("shard_serving", shard=shard.shard_index, num_shards=shard.num_shards, address=f"{host}:{bound}", run_id=shard.run_id,
             tls="mtls" if tls and tls.ca else ("tls" if tls else "plaintext"), token=bool(token))  # fmt: skip
    return server, bound

