"""`dilocox link`: the token bucket's tc arguments, the bulk probe on loopback, and real shaping of a
veth link between two network namespaces this test creates (and removes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from dilocox.common.deploy.link_probe import send_probe, sink_in_thread
from dilocox.common.deploy.link_shaping import TokenBucket


def test_token_bucket_arguments():
    assert TokenBucket(20).tc_args("eth1") == [
        "qdisc",
        "replace",
        "dev",
        "eth1",
        "root",
        "tbf",
        "rate",
        "20000kbit",
        "burst",
        str(66 * 1024),
        "latency",
        "100ms",
    ]
    assert TokenBucket(1000).burst_bytes == 1_250_000  # 10 ms at 1 Gbit/s
    with pytest.raises(ValueError, match="positive"):
        TokenBucket(0)


def test_probe_measures_loopback():
    port, thread, results = sink_in_thread(warmup_s=0.1)
    measured = send_probe("127.0.0.1", port, seconds=0.5)
    thread.join(timeout=10)
    assert results and (results[0].bytes_measured, results[0].bytes_total) == (
        measured.bytes_measured,
        measured.bytes_total,
    )
    assert measured.bytes_measured > 0 and measured.mbit_per_s > 10


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_namespaces():
    """Namespaces a and b joined by a veth pair (10.251.7.1 ↔ 10.251.7.2), deleted afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root, ip and tc to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"dlxl-{tag}-a", f"dlxl-{tag}-b"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"dlxa{tag}", "netns", a, "type", "veth", "peer", "name", f"dlxb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"dlxa{tag}", "10.251.7.1/30"), (b, f"dlxb{tag}", "10.251.7.2/30")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as error:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        pytest.skip(f"network namespaces unavailable here: {error.stderr.decode().strip()}")
    try:
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False, timeout=20)


@pytest.mark.timeout(120)
def test_shaped_veth_carries_the_configured_rate(two_namespaces):
    a, b = two_namespaces
    cli = [sys.executable, "-m", "dilocox.common.cli", "link"]
    shaped = subprocess.run(
        ["ip", "netns", "exec", b, *cli, "shape", "--towards", "10.251.7.1", "--rate-mbit", "40"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shaped.returncode == 0, shaped.stderr
    assert "tbf" in shaped.stderr and "40Mbit" in shaped.stderr  # the egress_shaped log shows the qdisc in force
    sink = subprocess.Popen(
        ["ip", "netns", "exec", a, *cli, "sink", "--host", "10.251.7.1", "--port", "5201"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(50):
            probe = subprocess.run(
                ["ip", "netns", "exec", b, *cli, "probe", "--to", "10.251.7.1:5201", "--seconds", "3"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if probe.returncode == 0:
                break
        assert probe.returncode == 0, probe.stderr
        rate = json.loads(probe.stdout.strip().splitlines()[-1])["mbit_per_s"]
        assert 40 * 0.85 <= rate <= 40 * 1.15, rate
    finally:
        sink.kill()
        sink.wait(timeout=10)
