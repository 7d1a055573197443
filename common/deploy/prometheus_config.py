"""A Prometheus configuration that scrapes a run's processes and evaluates the shipped alert rules.

`dilocox sim --metrics-port P` writes one into its log folder (shards on P + i, clusters on P + shards +
j), so the simulation can be watched the way a real run is: `prometheus --config.file <it>`, then the
Grafana dashboard of common/deploy/monitoring/. The same function serves a deployment's static targets.

Written as JSON, which is YAML: no YAML library needed to make it.
"""

from __future__ import annotations

import json
import pathlib
from importlib import resources

MONITORING = "monitoring"
ALERT_RULES = "dilocox-alerts.yml"
DASHBOARD = "dilocox-grafana.json"


def shipped(name: str) -> pathlib.Path:
    """Path of a file shipped in dilocox.common.deploy/monitoring (package data)."""
    return pathlib.Path(str(resources.files("dilocox.common.deploy") / MONITORING / name))


def sim_targets(metrics_port: int, shards: int, clusters: int, host: str = "127.0.0.1") -> dict[str, list[str]]:
    """The simulation's metrics endpoints by job: shard i on metrics_port + i, cluster j after the shards."""
    return {
        "dilocox-shards": [f"{host}:{metrics_port + i}" for i in range(shards)],
        "dilocox-sites": [f"{host}:{metrics_port + shards + j}" for j in range(clusters)],
    }


def render(
    targets: dict[str, list[str]], interval_s: float = 5.0, rule_files: tuple[pathlib.Path, ...] | None = None
) -> str:
    """prometheus.yml scraping `targets` (job → host:port list) every `interval_s`, with the shipped alert
    rules evaluated at the same interval unless other `rule_files` are given."""
    interval = f"{round(interval_s * 1000)}ms"  # Prometheus durations are integers of a unit
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(path) for path in (rule_files if rule_files is not None else (shipped(ALERT_RULES),))],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]} for job, hosts in targets.items()],
    }
    return json.dumps(config, indent=2) + "\n"
