"""Prometheus metrics of one shard, defined here and hooked into `Shard` through `on_publish`.

Two kinds of source, so that the RPC path gains no work:

* Events, recorded when a version is published (the shard's `on_publish` hook, called under its lock
  with `shard.last_round` already describing the close): rounds closed, contributions per cluster,
  clusters dropped at a deadline, and the decode / apply / round-latency timings.
* State, read when Prometheus scrapes (a custom collector over `Shard.status()`): version, open round,
  active clusters, and the byte counters the servicer already keeps on the shard.

Names start with `dilocox_`; docs/deploy.md lists the ones worth alerting on.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dilocox.server.shard import Shard
from dilocox.server.shard_records import Snapshot

# Seconds: per-round CPU work is milliseconds to seconds; a round over a WAN is seconds to an hour.
_WORK_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf"))
_ROUND_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


class _ShardStateCollector(Collector):
    """Reads the shard's live state at scrape time (no bookkeeping on the RPC path)."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def collect(self):  # noqa: ANN201 - prometheus_client protocol
        status = self.shard.status()
        yield GaugeMetricFamily(
            "dilocox_version", "Newest published global version (-1: not initialised)", value=status["version"]
        )
        yield GaugeMetricFamily(
            "dilocox_open_round", "Round the shard is collecting contributions for", value=status["open_round"]
        )
        yield GaugeMetricFamily(
            "dilocox_final_version",
            "The run's last version: its rounds and the end-of-run flush "
            "(-1: not known yet); progress is dilocox_version / this",
            value=status["final_version"],
        )
        yield GaugeMetricFamily(
            "dilocox_active_clusters", "Clusters currently taking part in rounds", value=len(status["clusters"])
        )
        yield GaugeMetricFamily(
            "dilocox_round_contributed_clusters",
            "Clusters whose whole contribution to the open round is in",
            value=len(status["contributed"]),
        )
        yield GaugeMetricFamily(
            "dilocox_min_clusters", "Contributions a round needs before it may close", value=status["min_clusters"]
        )
        yield GaugeMetricFamily(
            "dilocox_owned_elements", "Parameter elements this shard owns", value=status["num_elements"]
        )
        yield CounterMetricFamily(
            "dilocox_bytes_received", "Bytes of pushes received (gRPC message bytes)", value=status["bytes_in"]
        )
        yield CounterMetricFamily(
            "dilocox_bytes_sent", "Bytes of pulls sent (gRPC message bytes)", value=status["bytes_out"]
        )
        yield CounterMetricFamily(
            "dilocox_dropped_bytes",
            "Payload bytes of partial contributions a deadline discarded (their clusters deliver them the next round)",
            value=self.shard.dropped_bytes,
        )
        yield GaugeMetricFamily(
            "dilocox_kept_round_bytes",
            "Payload bytes of the newest versions' contributions kept for sites that come back behind (--keep-rounds)",
            value=self.shard.recent.bytes_kept(self.shard.snapshot),
        )
        if (disk := self.shard.recent.disk) is not None:
            yield GaugeMetricFamily(
                "dilocox_kept_rounds_disk_bytes",
                "Bytes of the versions' contributions kept on disk for sites back within --keep-rounds-s",
                value=disk.bytes_on_disk(),
            )
            yield GaugeMetricFamily(
                "dilocox_kept_rounds_disk_budget_bytes",
                "The disk they may use (--keep-rounds-disk-gb)",
                value=disk.budget_bytes,
            )
            oldest = disk.oldest_saved_at()
            yield GaugeMetricFamily(
                "dilocox_kept_rounds_reach_seconds",
                "How long ago the oldest version kept on disk was published: a site away longer pulls the whole model",
                value=0 if oldest is None else time.time() - oldest,
            )
        yield CounterMetricFamily(
            "dilocox_update_check_overruled",
            "Rounds the update check flagged more sites of than "
            "--update-check-max-flagged allows: merged as usual, nobody left out",
            value=self.shard.rounds_overruled,
        )
        yield CounterMetricFamily(
            "dilocox_checkpoint_failures",
            "Shard checkpoint saves that failed (disk full, I/O error, read-only): the rounds went on, unsaved",
            value=status["checkpoint_failures"],
        )
        yield GaugeMetricFamily(
            "dilocox_checkpoint_failing_rounds",
            "Versions in a row whose checkpoint save failed, up to now (0: the last save succeeded)",
            value=status["checkpoint_failing_rounds"],
        )
        yield from _site_families(status["sites"])
        yield GaugeMetricFamily(
            "dilocox_last_round_close_timestamp_seconds",
            "Unix time the last round closed (0: none since start)",
            value=status["last_round_closed_at"],
        )


def _site_families(sites: list[dict]):  # noqa: ANN202 - metric families
    """Per site, as this shard saw its rounds: made, late, and what its last push said."""
    families = {
        "rounds_made": CounterMetricFamily(
            "dilocox_site_rounds_made", "Rounds closed with the site's contribution", labels=["cluster"]
        ),
        "rounds_late": CounterMetricFamily(
            "dilocox_site_rounds_late",
            "Rounds closed without the site while it stayed in (quorum + grace; its part came with its next push)",
            labels=["cluster"],
        ),
        "last_tokens": GaugeMetricFamily(
            "dilocox_site_tokens", "The site's weight (tokens) in the last round it made", labels=["cluster"]
        ),
        "inner_steps": GaugeMetricFamily(
            "dilocox_site_inner_steps", "H of the site's last push, as it said", labels=["cluster"]
        ),
        "idle_s": GaugeMetricFamily(
            "dilocox_site_idle_seconds",
            "The site trainer's idle seconds at its last push's boundary",
            labels=["cluster"],
        ),
        "member": GaugeMetricFamily(
            "dilocox_site_member", "1 while the site is in the run, 0 once marked inactive", labels=["cluster"]
        ),
        "rounds_flagged": CounterMetricFamily(
            "dilocox_site_updates_flagged",
            "Rounds the update check flagged the site's update "
            "(outsized, disagreeing, against the previous round's update, or replayed)",
            labels=["cluster"],
        ),
        "rounds_excluded": CounterMetricFamily(
            "dilocox_site_updates_excluded",
            "Rounds the update check left the site's update out of "
            "(--update-check exclude, or clip for a flag other than its size)",
            labels=["cluster"],
        ),
        "rounds_clipped": CounterMetricFamily(
            "dilocox_site_updates_clipped",
            "Rounds the update check merged the site's update scaled down to the reference norm (--update-check clip)",
            labels=["cluster"],
        ),
        "quarantined": GaugeMetricFamily(
            "dilocox_site_quarantined",
            "1 while the site is quarantined by the update check (flagged "
            "rounds in a row; left out until a round passes)",
            labels=["cluster"],
        ),
    }
    for site in sites:
        for field, family in families.items():
            family.add_metric([site["cluster"]], float(site[field]))
    yield from families.values()


class ShardMetrics:
    """The metrics of one shard in its own registry; `attach()` hooks them in."""

    def __init__(self, shard: Shard, registry: CollectorRegistry | None = None) -> None:
        self.shard = shard
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.rounds_closed = Counter(
            "dilocox_rounds_closed", "Rounds closed (versions published after round 0)", registry=r
        )
        self.contributions = Counter(
            "dilocox_contributions", "Complete contributions that went into a closed round", ["cluster"], registry=r
        )
        self.clusters_dropped = Counter(
            "dilocox_clusters_dropped", "Clusters marked inactive because they missed a round deadline", registry=r
        )
        self.update_seconds = Histogram(
            "dilocox_update_seconds",
            "Per round: decoding the contributions, their weighted mean and the outer step (fused)",
            buckets=_WORK_BUCKETS,
            registry=r,
        )
        self.round_latency = Histogram(
            "dilocox_round_latency_seconds",
            "Per round: first contribution received to version published",
            buckets=_ROUND_BUCKETS,
            registry=r,
        )
        r.register(_ShardStateCollector(shard))

    def attach(self) -> ShardMetrics:
        """Chain onto the shard's `on_publish` (keeping a checkpointer already there); call once."""
        previous = self.shard.on_publish

        def on_publish(snapshot: Snapshot) -> None:
            self.observe_publish(snapshot)
            if previous is not None:
                previous(snapshot)

        self.shard.on_publish = on_publish
        return self

    def observe_publish(self, snapshot: Snapshot) -> None:
        stats = self.shard.last_round
        if snapshot.version < 1 or stats is None or stats.round != snapshot.version:
            return  # round 0 (initial weights) or a restore: not a closed round
        self.rounds_closed.inc()
        for cluster in stats.clusters:
            self.contributions.labels(cluster=cluster).inc()
        if stats.dropped:
            self.clusters_dropped.inc(len(stats.dropped))
        self.update_seconds.observe(stats.update_s)
        self.round_latency.observe(stats.latency_s)
