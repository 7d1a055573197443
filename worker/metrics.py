"""Prometheus metrics of one cluster (served by its rank 0), fed by `DilocoCluster`'s `on_round` hook.

What a site operator asks of a training job: is it making progress (rounds, inner steps, tokens, the
global version it holds), is it learning (train and eval loss), and is the WAN hidden behind compute
(compute vs idle seconds, bytes pushed and pulled). Per-round values arrive through the round loop's
hook; the byte counters are read from the aggregator client at scrape time, so they include the
initial push and pulls that are not part of any round. Under torchrun only rank 0 serves them, and its
byte counters are that rank's share of the cluster's traffic.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dilocox.worker.exchange.aggregator_client import AggregatorClient
    from dilocox.worker.exchange.cluster import RoundReport


class _ExchangeCollector(Collector):
    """Counters the aggregator client keeps (its traffic, its replay check, its carry), read at scrape time."""

    def __init__(self, client: AggregatorClient) -> None:
        self.client = client

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        traffic = self.client.traffic
        yield CounterMetricFamily(
            "dilocox_bytes_pushed", "Bytes this rank pushed to the shards (gRPC message bytes)", value=traffic.bytes_up
        )
        yield CounterMetricFamily(
            "dilocox_bytes_pulled",
            "Bytes this rank pulled from the shards (gRPC message bytes)",
            value=traffic.bytes_down,
        )
        yield CounterMetricFamily(
            "dilocox_replay_mismatches",
            "Replays of the outer step that differed from a shard's state digest (each followed by a full pull)",
            value=self.client.replay_check.mismatches,
        )
        yield CounterMetricFamily(
            "dilocox_carried_elements",
            "Pseudo-gradient elements a shard closed its round without, delivered with the next round",
            value=self.client.carry.elements,
        )
        yield CounterMetricFamily(
            "dilocox_dropped_local_rounds",
            "Local rounds trained and then discarded on a rejoin",
            value=traffic.dropped_rounds,
        )
        yield CounterMetricFamily(
            "dilocox_dropped_local_tokens", "Tokens of the discarded local rounds", value=traffic.dropped_tokens
        )


class _Labelled(Collector):
    """Every sample of `inner` with the run's and the site's labels added: a dashboard then tells sites apart
    by name, not by scrape address, and one Prometheus can watch several runs (prometheus_client has no
    constant labels; Prometheus's own target labels would need every operator's scrape config to say them)."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self.inner, self.labels = inner, labels

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        for family in self.inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(
                    sample.name, {**self.labels, **sample.labels}, sample.value, sample.timestamp, sample.exemplar
                )
            yield labelled


class WorkerMetrics:
    """One cluster's metrics in its own registry; pass `observe_round` as DilocoCluster's `on_round`.
    `run_id` and `cluster`, when given, label every sample (`run`, `cluster`: the label the shards' per-site
    metrics use)."""

    def __init__(
        self,
        client: AggregatorClient | None = None,
        registry: CollectorRegistry | None = None,
        run_id: str = "",
        cluster: str = "",
    ) -> None:
        labels = {k: v for k, v in (("run", run_id), ("cluster", cluster)) if v}
        self.registry = registry if registry is not None else CollectorRegistry()
        r = CollectorRegistry() if labels else self.registry  # the metrics themselves; served through the labels
        if labels:
            self.registry.register(_Labelled(r, labels))
        self.rounds = Counter("dilocox_worker_rounds", "Outer rounds this cluster completed", registry=r)
        self.inner_steps = Counter("dilocox_inner_steps", "Inner optimiser steps taken", registry=r)
        self.tokens = Counter("dilocox_tokens_trained", "Tokens trained on (the rounds' averaging weights)", registry=r)
        self.round = Gauge("dilocox_worker_round", "Last round this cluster completed", registry=r)
        self.version = Gauge("dilocox_worker_version", "Global version this cluster last folded in", registry=r)
        self.train_loss = Gauge("dilocox_train_loss", "Mean training loss of the last round's inner steps", registry=r)
        self.eval_loss = Gauge("dilocox_eval_loss", "Held-out loss after the last round", registry=r)
        self.compute_seconds = Counter("dilocox_compute_seconds", "Seconds spent in inner steps", registry=r)
        self.idle_seconds = Counter(
            "dilocox_idle_seconds", "Seconds the trainer blocked waiting for the network", registry=r
        )
        self.comm_seconds = Counter(
            "dilocox_exchange_seconds", "Seconds the rounds' push and pull took (hidden or not)", registry=r
        )
        self.round_inner_steps = Gauge(
            "dilocox_round_inner_steps", "H of the last round (time-boxed rounds set it per site)", registry=r
        )
        self.late_rounds = Counter(
            "dilocox_late_rounds",
            "Rounds a shard closed without this site's push (quorum + grace): that part went with the next push",
            registry=r,
        )
        self.residual_norm = Gauge(
            "dilocox_error_feedback_residual_norm",
            "L2 norm of what compression still holds back (error-feedback residuals)",
            registry=r,
        )
        self.eval_to_best = Gauge(
            "dilocox_eval_loss_to_best_ratio",
            "The last round's eval loss over the best before it "
            "(> 1.5: a spike, worker/exchange/loss_watch.py; +Inf: not finite)",
            registry=r,
        )
        self.rising_rounds = Gauge(
            "dilocox_eval_loss_rising_rounds",
            "Rounds in a row the eval loss has been over 1.1× its "
            "best (≥ 3: loss_rising, worker/exchange/loss_watch.py)",
            registry=r,
        )
        self.nonfinite = Counter(
            "dilocox_nonfinite_losses", "Rounds whose train or eval loss was not finite", registry=r
        )
        self.train_loss.set(math.nan)
        self.eval_loss.set(math.nan)
        self.eval_to_best.set(math.nan)
        if client is not None:
            r.register(_ExchangeCollector(client))

    def observe_round(self, report: RoundReport, inner_steps: int, version: int) -> None:
        self.rounds.inc()
        self.inner_steps.inc(inner_steps)
        self.round_inner_steps.set(inner_steps)
        if report.late:
            self.late_rounds.inc()
        self.tokens.inc(report.tokens)
        self.round.set(report.round)
        self.version.set(version)
        self.train_loss.set(report.train_loss)
        if not math.isnan(report.eval_loss):  # not evaluated this round: keep the last value
            self.eval_loss.set(report.eval_loss)
        if report.loss_alarm == "nonfinite":
            self.nonfinite.inc()
        if not math.isnan(report.eval_to_best) or report.loss_alarm == "nonfinite":
            self.eval_to_best.set(math.inf if report.loss_alarm == "nonfinite" else report.eval_to_best)
            self.rising_rounds.set(report.loss_rising_rounds)
        self.compute_seconds.inc(max(0.0, report.compute_s))
        self.idle_seconds.inc(max(0.0, report.idle_s))
        self.comm_seconds.inc(max(0.0, report.comm_s))
        self.residual_norm.set(report.residual_norm)
