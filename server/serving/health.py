"""Standard gRPC health checking (grpc.health.v1) for shards, and `dilocox health` to query it.

Orchestrators (the docker-compose healthcheck, Kubernetes probes, load balancers) speak the standard
health protocol, not our Status RPC, and they must not need the run's token or parse our messages. So
every shard registers the stock `grpc.health.v1.Health` service: NOT_SERVING while it starts,
SERVING once it listens (after any `--resume` has restored its state), and NOT_SERVING again as soon
as it begins to shut down, so traffic drains before the port closes — and NOT_SERVING while its work
pool cannot take work (server/serving/health_watch.py). Both the overall status ("")
and the named service `dilocox.v1.Aggregator` are reported.

`dilocox health` is the client side: exit 0 when the shard answers SERVING, exit 1 otherwise (never 2,
which docker reserves), with one line saying why.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dilocox.common.security import TlsFiles, add_security_arguments, open_channel, security_from_args

SERVICE = "dilocox.v1.Aggregator"
NAMES = ("", SERVICE)  # the overall status and the named service: both are reported


async def add_health_service(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """Register grpc.health.v1 on `server` (before it starts), reporting NOT_SERVING until `mark_serving`.
    A shard serves on grpc.aio (server/serving/grpc_server.py), so this is the stock service's asyncio form;
    `enter_graceful_shutdown()` on it turns every service NOT_SERVING for good."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in NAMES:
        await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


async def mark_serving(servicer: health.aio.HealthServicer) -> None:
    for name in NAMES:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def check(
    address: str, timeout: float = 5.0, tls: TlsFiles | None = None, token: str | None = None, service: str = ""
) -> tuple[bool, str]:
    """Ask one shard for its health; (serving?, a one-line explanation)."""
    channel = open_channel(address, [], tls, token)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as error:
        code = error.code() if hasattr(error, "code") else None
        if code == grpc.StatusCode.NOT_FOUND:
            return False, f"{address} does not know the service {service!r}"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return False, f"{address} answers gRPC but has no health service (not a dilocox shard, or an old one)"
        name = code.name if code is not None else "ERROR"
        details = error.details() if hasattr(error, "details") else str(error)
        return False, f"{address} did not answer within {timeout:g}s: {name}: {details}"
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} {status}"


# --------------------------------------------------------------------------- `dilocox health`
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", required=True, help="host:port of the shard to check")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    parser.add_argument("--service", default="", help=f"service to ask about (default: the whole server; or {SERVICE})")
    add_security_arguments(parser, "worker")


def run(args: argparse.Namespace) -> int:
    try:
        tls, token = security_from_args(args, "worker")
    except ValueError as error:
        print(f"dilocox health: {error}", file=sys.stderr)
        return 1
    if args.timeout <= 0:
        print(f"dilocox health: --timeout must be positive, got {args.timeout}", file=sys.stderr)
        return 1
    serving, message = check(args.server, args.timeout, tls, token, args.service)
    if serving:
        print(message)
        return 0
    print(f"dilocox health: not healthy: {message}", file=sys.stderr)
    return 1
