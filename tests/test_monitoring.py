"""The shipped Prometheus alert rules and Grafana dashboard (common/deploy/monitoring/) name only metrics
that a shard and a site really export, and the rules pass `promtool check rules` where it is installed."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.framing import EncodedSlice
from dilocox.server.metrics import ShardMetrics
from dilocox.server.shard import Shard
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.round_report import RoundReport
from dilocox.worker.metrics import WorkerMetrics

MONITORING = pathlib.Path(__file__).resolve().parents[1] / "common" / "deploy" / "monitoring"
RULES = MONITORING / "dilocox-alerts.yml"
DASHBOARD = MONITORING / "dilocox-grafana.json"
METRIC = re.compile(r"\bdilocox_[a-z_]+\b")


def _exported_sample_names() -> set[str]:
    """Every sample name a shard (after a closed round) and a site (after a round) expose."""
    shard = Shard(0, 1, "run-monitoring", min_clusters=1)
    metrics = ShardMetrics(shard).attach()
    params = [("w", (4, 2))]
    for cluster in ("a", "b"):
        shard.join("run-monitoring", cluster, model_digest(params), params)

    def whole(value: float) -> list[EncodedSlice]:
        return [EncodedSlice.exact(key, torch.full(owned.slice_shape, value)) for key, owned in shard.owned.items()]

    shard.commit_push("a", 0, 1.0, whole(0.0))
    for cluster in ("a", "b"):
        shard.commit_push(cluster, 1, 10.0, whole(1.0), inner_steps=8, idle_s=0.5)
    assert shard.version == 1
    client = AggregatorClient(["127.0.0.1:1"], "run-monitoring", "a")  # never connects: its counters are read
    try:
        worker = WorkerMetrics(client)
        worker.observe_round(
            RoundReport(
                round=1,
                train_loss=2.0,
                eval_loss=2.1,
                tokens=512,
                bytes_up=1,
                bytes_down=1,
                compute_s=1.0,
                comm_s=0.5,
                idle_s=0.1,
                seconds=1.2,
                overlap=0.8,
                inner_steps=8,
            ),
            8,
            1,
        )
        text = generate_latest(metrics.registry).decode() + generate_latest(worker.registry).decode()
    finally:
        client.close()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _named(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in METRIC.findall(expr)}


def named_by_rules_and_dashboard(rules_path: pathlib.Path = RULES) -> set[str]:
    """Every metric the alert rules at `rules_path` and the shipped dashboard's panels name."""
    rules = yaml.safe_load(rules_path.read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    exprs += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return _named(exprs)


def test_every_metric_the_rules_and_the_dashboard_name_is_exported():
    rules = yaml.safe_load(RULES.read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert {"DilocoxRunStalled", "DilocoxSiteGone", "DilocoxRoundOverDeadline", "DilocoxReplayMismatch"} <= alerts
    named = named_by_rules_and_dashboard()
    assert len(named) >= 15, named
    missing = named - _exported_sample_names()
    assert not missing, f"named by the rules or the dashboard but not exported: {sorted(missing)}"


def test_promtool_checks_the_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package has it): the rules were not checked by it")
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_fires_the_loss_alerts_for_one_site_and_for_all_of_them(tmp_path):
    """One site's spike is a site alert; every site's at once is the global model's; a
    non-finite loss is critical. Prometheus' own rule tests (`promtool test rules`) on the shipped rules."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package has it): the rules were not run")

    def alerts(*instances: str, severity: str) -> list[dict]:
        return [{"exp_labels": {"severity": severity, **({"instance": i} if i else {})}} for i in instances]

    # The expressions under test; the annotations (templated text) are left out of the comparison.
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    cases = {
        "rule_files": [str(tmp_path / "rules.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'dilocox_eval_loss_to_best_ratio{instance="site-a"}', "values": "1 1.02 3.5 3.5"},
                    {"series": 'dilocox_eval_loss_to_best_ratio{instance="site-b"}', "values": "1 0.98 1.1 2.4"},
                    {"series": 'dilocox_nonfinite_losses_total{instance="site-a"}', "values": "0 0 0 1"},
                ],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "DilocoxSiteLossSpike", "exp_alerts": []},
                    {
                        "eval_time": "2m",
                        "alertname": "DilocoxSiteLossSpike",
                        "exp_alerts": alerts("site-a", severity="warning"),
                    },
                    {"eval_time": "2m", "alertname": "DilocoxGlobalLossSpike", "exp_alerts": []},
                    {
                        "eval_time": "3m",
                        "alertname": "DilocoxGlobalLossSpike",
                        "exp_alerts": alerts("", severity="critical"),
                    },
                    {"eval_time": "2m", "alertname": "DilocoxLossNonFinite", "exp_alerts": []},
                    {
                        "eval_time": "3m",
                        "alertname": "DilocoxLossNonFinite",
                        "exp_alerts": alerts("site-a", severity="critical"),
                    },
                ],
            }
        ],
    }
    path = tmp_path / "loss-alerts-test.yml"
    path.write_text(yaml.safe_dump(cases))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_sites_metrics_carry_its_run_and_name():
    """Every sample of a worker's registry is labelled run= and cluster= (the dashboard's legend), and the
    shards export the run's last version beside their own (the progress and ETA panels)."""
    worker = WorkerMetrics(run_id="run-7", cluster="site-a")
    worker.observe_round(
        RoundReport(
            round=3,
            train_loss=2.0,
            eval_loss=2.1,
            tokens=512,
            bytes_up=1,
            bytes_down=1,
            compute_s=1.0,
            comm_s=0.5,
            idle_s=0.1,
            seconds=1.2,
            overlap=0.8,
            inner_steps=8,
        ),
        8,
        3,
    )
    families = list(text_string_to_metric_families(generate_latest(worker.registry).decode()))
    samples = [sample for family in families for sample in family.samples]
    assert len(samples) >= 15 and all(
        s.labels.get("run") == "run-7" and s.labels.get("cluster") == "site-a" for s in samples
    )
    assert worker.registry.get_sample_value("dilocox_worker_round", {"run": "run-7", "cluster": "site-a"}) == 3

    shard = Shard(0, 1, "run-7")
    metrics = ShardMetrics(shard).attach()
    assert (
        metrics.registry.get_sample_value("dilocox_final_version") == -1
    )  # not known before a site joins with the run's config
