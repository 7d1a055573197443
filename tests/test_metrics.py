"""Prometheus metrics: a real `dilocox server` process with --metrics-port, real clients, a real scrape."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dilocox.common.subprocesses import stop_gracefully
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors

RUN = "run-metrics"
PARAMS = [("w", (32, 8)), ("b", (8,))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape of http://127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def shard_process(tmp_path):
    metrics_port = _free_port()
    port_file = tmp_path / "port"
    argv = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--run-id",
        RUN,
        "--min-clusters",
        "2",
        "--metrics-port",
        str(metrics_port),
        "--insecure",
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "shard did not start"
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text()}", metrics_port, proc
    finally:
        stop_gracefully(proc, grace_s=20)


def test_shard_metrics_after_a_round(shard_process):
    address, metrics_port, proc = shard_process
    started_wall, started = time.time(), time.monotonic()
    before = scrape(metrics_port)
    assert before[("dilocox_version", ())] == -1 and before[("dilocox_rounds_closed_total", ())] == 0
    clients = {c: AggregatorClient([address], RUN, c, connect_timeout=10, rpc_timeout=30) for c in ("a", "b")}
    try:
        g = torch.Generator().manual_seed(0)
        infos = {c: client.join(PARAMS) for c, client in clients.items()}
        theta0 = {name: torch.randn(shape, generator=g) for name, shape in PARAMS}
        clients["a"].push(0, 1.0, slice_tensors(infos["a"].assignment, theta0))
        for client in clients.values():
            delta = {name: torch.randn(shape, generator=g) for name, shape in PARAMS}
            client.push(1, 100.0, slice_tensors(client.assignment, delta))
        for client in clients.values():
            version, _, received = client.pull(min_version=1, wait_seconds=10)
            assert version == 1 and received > 0
        up = sum(client.traffic.bytes_up for client in clients.values())
    finally:
        for client in clients.values():
            client.close()

    m = scrape(metrics_port)
    assert m[("dilocox_rounds_closed_total", ())] == 1
    assert m[("dilocox_version", ())] == 1 and m[("dilocox_open_round", ())] == 2
    assert m[("dilocox_active_clusters", ())] == 2
    assert m[("dilocox_contributions_total", (("cluster", "a"),))] == 1
    assert m[("dilocox_contributions_total", (("cluster", "b"),))] == 1
    assert m[("dilocox_bytes_received_total", ())] == up  # the shard counts what the clients sent
    assert m[("dilocox_bytes_sent_total", ())] > 4 * 32 * 8  # at least the weights, twice over
    for histogram in ("dilocox_update_seconds", "dilocox_round_latency_seconds"):
        assert m[(f"{histogram}_count", ())] == 1
        assert 0 <= m[(f"{histogram}_sum", ())] <= time.monotonic() - started  # within the test, not a speed bound
    assert m[("dilocox_clusters_dropped_total", ())] == 0
    assert started_wall - 1 <= m[("dilocox_last_round_close_timestamp_seconds", ())] <= time.time() + 1

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    with pytest.raises(OSError):  # the endpoint goes away with the shard
        scrape(metrics_port)


SITE = (("cluster", "site-a"), ("run", "run-worker-metrics"))  # every worker sample carries its site and run


def test_worker_metrics_while_training(shard_set):
    """A real `dilocox worker` (tiny model) serves its round metrics from rank 0 while it trains, each
    sample labelled with its site and run."""
    shards = shard_set(1, "run-worker-metrics")
    metrics_port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "worker",
        "--servers",
        shards.addresses[0],
        "--run-id",
        "run-worker-metrics",
        "--cluster",
        "site-a",
        "--rounds",
        "1000",
        "--inner-steps",
        "3",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "16",
        "--inner-batch-size",
        "4",
        "--eval-batches",
        "1",
        "--threads",
        "1",
        "--metrics-port",
        str(metrics_port),
        "--metrics-host",
        "127.0.0.1",
        "--insecure",
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        deadline, m = time.monotonic() + 120, {}
        while m.get(("dilocox_worker_rounds_total", SITE), 0) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"worker did not complete 3 rounds: {m}"
            time.sleep(0.2)
            try:
                m = scrape(metrics_port)
            except OSError:
                continue  # not serving yet
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    rounds = m[("dilocox_worker_rounds_total", SITE)]
    assert m[("dilocox_inner_steps_total", SITE)] == 3 * rounds
    assert m[("dilocox_tokens_trained_total", SITE)] == 3 * 4 * 16 * rounds
    assert m[("dilocox_worker_round", SITE)] >= rounds and m[("dilocox_worker_version", SITE)] >= rounds - 1
    assert (
        0 < m[("dilocox_train_loss", SITE)] < 10 and 0 < m[("dilocox_eval_loss", SITE)] < 10
    )  # bytes: ln 256 ≈ 5.5 at first
    assert m[("dilocox_bytes_pushed_total", SITE)] > 0 and m[("dilocox_bytes_pulled_total", SITE)] > 0
    assert m[("dilocox_compute_seconds_total", SITE)] > 0 and m[("dilocox_idle_seconds_total", SITE)] >= 0
    assert m[("dilocox_error_feedback_residual_norm", SITE)] > 0  # default compression: int4 + error feedback
