"""A push whose reply is lost on a half-open connection: the shard took the push, the reply and
every later byte from the shard vanish, and the connection stays open — as when a link goes down just
after a shard answered. gRPC keepalive notices the dead connection, the push is retried over a new one
like after an outage, and the shard answers it as a duplicate: the round is applied once."""

from __future__ import annotations

import socket
import threading
import time

import torch

from dilocox.common.config.run import WireConfig
from dilocox.common.wire.assignment import model_digest
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import Shard
from dilocox.worker.exchange.aggregator_client import AggregatorClient

PARAMS = [("w", (8, 4)), ("b", (8,))]
RUN = "partition-run"


class HalfOpenProxy:
    """A TCP proxy on loopback. `cut_replies()` makes every connection open at that moment drop what the
    shard sends (read and discarded) while it keeps forwarding what the client sends: a half-open link.
    Connections made afterwards are forwarded both ways."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut: set[int] = set()  # ids of connections whose shard-to-client bytes are dropped
        self.open: list[int] = []
        self.dropped_bytes = 0
        self._next = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_replies(self) -> None:
        self.cut.update(self.open)

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            shard = socket.create_connection(("127.0.0.1", self.target_port))
            self._next += 1
            conn = self._next
            self.open.append(conn)
            threading.Thread(target=self._pump, args=(client, shard, conn, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(shard, client, conn, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, conn: int, from_shard: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:
                return
            if from_shard and conn in self.cut:
                self.dropped_bytes += len(data)
                continue  # lost: the connection stays open, nothing arrives
            try:
                sink.sendall(data)
            except OSError:
                return


def test_a_push_whose_reply_is_lost_is_retried_and_applied_once():
    shard = Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9, min_clusters=1)
    server, port = start_server(shard, "127.0.0.1", 0)
    proxy = HalfOpenProxy(port)
    wire = WireConfig(keepalive_s=1.0)  # 30 s in production: the same path, a test-sized wait
    try:
        with AggregatorClient(
            [f"127.0.0.1:{proxy.port}"], RUN, "site-a", wire, connect_timeout=10, rpc_timeout=120, shard_wait_s=60
        ) as client:
            client.join(PARAMS)
            torch.manual_seed(0)
            theta0 = {s.key: torch.randn(s.slice_shape) for s in client.assignment}
            client.push(0, 1.0, theta0)
            assert client.pull(min_version=0)[0] == 0
            delta = {key: torch.full_like(t, 0.5) for key, t in theta0.items()}
            proxy.cut_replies()
            started = time.monotonic()
            client.push(1, 100.0, delta)  # taken by the shard; its reply is lost on the half-open connection
            took = time.monotonic() - started
            version, weights, _ = client.pull(min_version=1)
        assert proxy.dropped_bytes > 0  # the reply really was lost
        assert took < 30, (
            f"the lost reply was noticed after {took:.1f}s (keepalive 1 s; the push's own deadline is 120 s)"
        )
        assert version == shard.version == 1  # round 1 closed once; the retry did not open or close another
        contributions = shard.snapshot.contributions
        assert all(list(per) == ["site-a"] for per in contributions.values())
        for key, tensor in theta0.items():  # θ1 = θ0 − η·Δ (a first Nesterov step: momentum μΔ + Δ)
            expected = tensor - 0.7 * (0.9 * 0.5 + 0.5)
            assert torch.allclose(weights[key], expected) and torch.allclose(shard.snapshot.tensors[key], expected)
    finally:
        proxy.close()
        server.stop(0)


def test_keepalive_options_are_accepted_by_a_shard_at_any_client_rate():
    """The shard accepts pings as often as a client sends them (gRPC's default GOAWAYs a client pinging
    more often than every 5 minutes, which would turn keepalive itself into an outage)."""
    shard = Shard(0, 1, RUN, outer_lr=0.7, outer_momentum=0.9)
    server, port = start_server(shard, "127.0.0.1", 0)
    try:
        with AggregatorClient(
            [f"127.0.0.1:{port}"], RUN, "site-a", WireConfig(keepalive_s=0.2), connect_timeout=10
        ) as client:
            client.join(PARAMS)
            time.sleep(2.0)  # ~10 idle pings
            assert client.status_each()[0].shard_index == 0  # the connection is still good
            assert shard.digest == model_digest(PARAMS)
    finally:
        server.stop(0)


def test_a_site_finishes_its_run_through_a_half_open_link(tmp_path):
    """A real worker process and a real shard process, the shard's replies lost mid-run on every
    connection open at that moment (which stay open): the site finishes the run, every round applied
    once (its replica of the global weights is checked against the shard's digest each round)."""
    import json
    import subprocess
    import sys

    import grpc

    from dilocox.bench.site_layouts import shard_processes
    from dilocox.proto import dilocox_pb2 as pb
    from dilocox.proto import dilocox_pb2_grpc as pb_grpc

    run_id, rounds = "partition-site", 6
    with shard_processes(1, run_id, tmp_path) as addresses:
        proxy = HalfOpenProxy(int(addresses[0].rsplit(":", 1)[1]))
        log = open(tmp_path / "worker.log", "w")
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dilocox.common.cli",
                "worker",
                "--servers",
                f"127.0.0.1:{proxy.port}",
                "--run-id",
                run_id,
                "--insecure",
                "--log-format",
                "json",
                "--wire-keepalive-s",
                "1",
                "--rounds",
                str(rounds),
                "--inner-steps",
                "20",
                "--n-layer",
                "1",
                "--n-embd",
                "32",
                "--block-size",
                "32",
                "--eval-batches",
                "1",
                "--threads",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            with grpc.insecure_channel(addresses[0]) as channel:  # straight to the shard, around the proxy
                stub, deadline = pb_grpc.AggregatorStub(channel), time.monotonic() + 120
                while stub.Status(pb.StatusRequest(), timeout=5).version < 2:
                    assert time.monotonic() < deadline and worker.poll() is None, (tmp_path / "worker.log").read_text()[
                        -3000:
                    ]
                    time.sleep(0.05)
            proxy.cut_replies()
            assert worker.wait(timeout=240) == 0, (tmp_path / "worker.log").read_text()[-4000:]
        finally:
            if worker.poll() is None:
                worker.kill()
            proxy.close()
    events = [json.loads(line) for line in (tmp_path / "worker.log").read_text().splitlines() if line.startswith("{")]
    done = [e for e in events if e.get("event") == "cluster_done"]
    assert done and done[0]["version"] == rounds + 1 and done[0]["rounds"] == rounds  # every round, then the flush
    assert not [e for e in events if e.get("event") == "replay_mismatch"]  # no round applied twice or lost
    assert proxy.dropped_bytes > 0 and proxy.cut  # the link really went half-open under it
