"""The monitoring, for real: Debian's Prometheus scrapes a running `dilocox sim` (its shards and clusters
serve /metrics with --metrics-port) through the configuration the sim writes, evaluates the shipped alert
rules without error, and every metric the rules and the Grafana dashboard name is in what it scraped.

Prometheus is installed with apt-get where missing (root); elsewhere the test says SKIPPED and why."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.request

import pytest

from dilocox.common.deploy import prometheus_config
from tests.debian_packages import PackageUnavailable, ensure
from tests.ports import free_port_range
from tests.test_monitoring import RULES, named_by_rules_and_dashboard

SHARDS, CLUSTERS = 2, 2


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"prometheus not ready within {timeout:g}s")


@pytest.fixture
def prometheus_binary():
    try:
        ensure("prometheus", ("prometheus", "promtool"))
    except PackageUnavailable as error:
        pytest.skip(f"Prometheus: {error}")
    return "prometheus"


def test_prometheus_scrapes_a_running_sim_and_finds_every_metric_the_rules_and_dashboard_name(
    prometheus_binary, tmp_path
):
    metrics_port, web_port = free_port_range(SHARDS + CLUSTERS), free_port_range(1)
    log_dir = tmp_path / "sim"
    log_dir.mkdir()
    # The configuration the sim writes, made here first: Prometheus is up (and retrying the targets) before
    # the processes start, so it scrapes them from their first second.
    config = tmp_path / "prometheus.yml"
    targets = prometheus_config.sim_targets(metrics_port, SHARDS, CLUSTERS)
    config.write_text(prometheus_config.render(targets, interval_s=0.5))
    url = f"http://127.0.0.1:{web_port}"
    server = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    try:
        _wait_ready(url, server)
        sim = subprocess.run(
            [
                sys.executable,
                "-m",
                "dilocox.common.cli",
                "sim",
                "--shards",
                str(SHARDS),
                "--clusters",
                str(CLUSTERS),
                "--rounds",
                "6",
                "--inner-steps",
                "10",
                "--n-layer",
                "1",
                "--n-embd",
                "32",
                "--block-size",
                "32",
                "--inner-batch-size",
                "8",
                "--eval-batches",
                "2",
                "--no-tensorboard",
                "--metrics-port",
                str(metrics_port),
                "--log-dir",
                str(log_dir),
                "--log-format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert sim.returncode == 0, sim.stdout[-3000:] + sim.stderr[-3000:]
        written = (log_dir / "prometheus.yml").read_text()
        assert json.loads(written)["scrape_configs"] == json.loads(config.read_text())["scrape_configs"]
        assert "sim_prometheus" in sim.stdout + sim.stderr
        time.sleep(1.0)  # the last scrape's samples are committed

        # Every process was scraped, and up while it ran.
        series = _get(f"{url}/api/v1/query?query=max_over_time(up[10m])")
        seen = {r["metric"]["instance"]: float(r["value"][1]) for r in series["result"]}
        assert seen == {t: 1.0 for hosts in targets.values() for t in hosts}, seen
        # Every metric the shipped rules and dashboard name is in the scrape.
        scraped = set(_get(f"{url}/api/v1/label/__name__/values"))
        rules = prometheus_config.shipped(prometheus_config.ALERT_RULES)
        named = named_by_rules_and_dashboard(rules)
        assert len(named) >= 15, named
        missing = sorted(named - scraped)
        assert not missing, f"named by the rules or the dashboard, absent from the scrape of a running sim: {missing}"
        # The alert rules load and evaluate without error against these series.
        groups = _get(f"{url}/api/v1/rules")["groups"]
        loaded = [rule for group in groups for rule in group["rules"]]
        assert {r["name"] for r in loaded} >= {"DilocoxRunStalled", "DilocoxSiteGone", "DilocoxReplayMismatch"}
        assert all(r["health"] == "ok" and not r.get("lastError") for r in loaded), loaded
        assert pathlib.Path(rules).samefile(RULES)
    finally:
        server.terminate()
        server.wait(timeout=30)
