"""Adaptive H: the inner steps per round grow until the exchange hides behind compute."""

from __future__ import annotations

import time

import pytest
import structlog
import torch

from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import Shard
from dilocox.worker.exchange.adaptive_steps import StepsController
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import DilocoCluster


def test_controller_grows_shrinks_caps_and_can_be_pinned():
    c = StepsController(base_steps=10, max_steps=50, target=1.0)
    assert c.update(1, compute_s=1.0, comm_s=2.0) == 20  # a step takes 0.1 s: 20 steps cover 2 s
    assert c.update(2, compute_s=2.0, comm_s=9.0) == 50  # capped at max_steps
    assert c.update(3, compute_s=5.0, comm_s=4.9) == 50  # fits: unchanged
    assert c.update(4, compute_s=5.0, comm_s=0.5) == 10  # link mostly idle: back to the base, not below
    pinned = StepsController(10, 50, enabled=False)
    assert pinned.update(1, 1.0, 100.0) == 10
    with pytest.raises(ValueError):
        StepsController(10, 5)


class SteppedToy:
    """A toy trainer whose compute time is proportional to the steps it runs."""

    def __init__(self, step_s: float) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.step_s = step_s
        self.steps_run: list[int] = []

    def named_parameters(self):
        return list(self.model.named_parameters())

    def train_steps(self, n: int):
        started = time.perf_counter()
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01)
        time.sleep(n * self.step_s)
        self.steps_run.append(n)
        return 0.0, n, time.perf_counter() - started

    def evaluate(self) -> float:
        return 0.0


def test_steps_grow_until_the_slow_link_is_hidden():
    shard = Shard(0, 1, "adaptive")
    server, port = start_server(shard, "127.0.0.1", 0, added_latency_s=0.15)
    client = AggregatorClient([f"127.0.0.1:{port}"], "adaptive", "c", connect_timeout=10, rpc_timeout=30)
    trainer = SteppedToy(step_s=0.01)
    try:
        with structlog.testing.capture_logs() as logs:
            cluster = DilocoCluster(
                trainer, client, rounds=7, inner_steps=2, delay=1, steps_controller=StepsController(2, 100, target=0.9)
            )
            cluster.run()
    finally:
        client.close()
        server.stop(grace=None)
    assert trainer.steps_run[0] == 2 and max(trainer.steps_run) >= 20  # an exchange ≈ 0.3 s, a step 0.01 s
    adapted = [e for e in logs if e["event"] == "inner_steps_adapted"]
    assert adapted and all("exchange took" in e["reason"] for e in adapted)
    # Once grown, each exchange runs beside a round's compute that is as long as an exchange: of it, at least
    # what the compute covered is hidden (a share of wall time would be a timing bound a loaded machine breaks).
    late = cluster.reports[-2:]
    shown = [(round(r.idle_s, 3), round(r.comm_s, 3), round(r.compute_s, 3)) for r in late]
    assert all(r.comm_s - r.idle_s >= 0.8 * min(r.comm_s, r.compute_s) for r in late), shown
