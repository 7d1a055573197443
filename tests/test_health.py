"""grpc.health.v1 on shards and `dilocox health`: what the docker-compose healthcheck relies on."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import grpc

from dilocox.server.serving import health
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import Shard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shard_reports_serving_and_stops_answering_after_stop(shard_set):
    shards = shard_set(1, "run-health")
    address = shards.addresses[0]
    assert health.check(address, timeout=5) == (True, f"{address} SERVING")
    assert health.check(address, timeout=5, service=health.SERVICE)[0]
    serving, message = health.check(address, timeout=5, service="no.such.Service")
    assert not serving and "does not know the service" in message
    shards.stop()
    serving, message = health.check(address, timeout=2)
    assert not serving and "did not answer" in message and "UNAVAILABLE" in message


def test_not_serving_before_start_and_after_shutdown_begins():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coroutine):  # noqa: ANN001, ANN202
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=30)

    async def started():  # noqa: ANN202
        server = grpc.aio.server()
        servicer = await health.add_health_service(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, servicer, port

    server, servicer, port = on_loop(started())
    try:
        address = f"127.0.0.1:{port}"
        assert health.check(address, timeout=5) == (False, f"{address} NOT_SERVING")
        on_loop(health.mark_serving(servicer))
        assert health.check(address, timeout=5)[0]
        on_loop(servicer.enter_graceful_shutdown())
        on_loop(health.mark_serving(servicer))  # ignored once shutting down
        assert health.check(address, timeout=5) == (False, f"{address} NOT_SERVING")
    finally:
        on_loop(server.stop(None))
        loop.call_soon_threadsafe(loop.stop)


def test_health_needs_no_run_token():
    """Probes hold no secrets: a shard that checks the run token still answers the health service."""
    shard = Shard(0, 1, "run-health")
    server, port = start_server(shard, "127.0.0.1", 0, token="s3cret")
    try:
        assert health.check(f"127.0.0.1:{port}", timeout=5)[0]
        assert health.check(f"127.0.0.1:{port}", timeout=5, token="s3cret")[0]
    finally:
        server.stop(None).wait(timeout=10)


def test_cli_exit_codes(shard_set):
    """`dilocox health` exits 0 for SERVING, 1 (never docker's reserved 2) with a reason otherwise."""
    address = shard_set(1, "run-health").addresses[0]
    dead = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "dilocox.common.cli", "health", "--insecure", "--timeout", "3", "--server"]
    procs = {
        a: subprocess.Popen(argv + [a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for a in (address, dead)
    }
    results = {a: (p.wait(timeout=60), p.stdout.read(), p.stderr.read()) for a, p in procs.items()}
    code, out, _ = results[address]
    assert code == 0 and out.strip() == f"{address} SERVING"
    code, _, err = results[dead]
    assert code == 1 and "not healthy" in err and dead in err
