"""A whole run in one process: shards on localhost gRPC ports, clusters on threads.

For benchmarks and tests that need real gRPC traffic and the real round loop but not one OS process
per role (the sim does that). Clusters run concurrently, because a round only closes once all of them
have pushed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dilocox.common.config.run import RunConfig, as_dict
from dilocox.common.wire.compression import TensorCompressor
from dilocox.server.checks.robust_mean import AggregateConfig
from dilocox.server.checks.update_check import UpdateCheckConfig
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import DEFAULT_KEEP_ROUNDS, Shard
from dilocox.sim.push_fault import FaultyPushClient, PushFault
from dilocox.worker.data.corpus import load_corpus
from dilocox.worker.data.token_data import TokenData
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import DilocoCluster, RoundReport
from dilocox.worker.train.inner_trainer import InnerTrainer


@dataclass
class InProcessResult:
    clusters: list[DilocoCluster]
    shards: list[Shard]
    num_params: int

    def steady_reports(self) -> list[RoundReport]:
        """Every cluster's reports from round 2 on (round 1 pulls no contributions and, with the
        delay, has nothing in flight yet); all of them for a one-round run."""
        steady = [r for c in self.clusters for r in c.reports[1:]]
        return steady or [r for c in self.clusters for r in c.reports]

    def bytes_per_round(self) -> tuple[float, float]:
        """Mean (uplink, downlink) bytes per cluster per steady round, at the gRPC message layer."""
        steady = self.steady_reports()
        return sum(r.bytes_up for r in steady) / len(steady), sum(r.bytes_down for r in steady) / len(steady)

    def mean_final_eval_loss(self) -> float:
        return sum(c.final_eval_loss for c in self.clusters) / len(self.clusters)


def run_in_process(
    config: RunConfig,
    num_clusters: int = 2,
    num_shards: int = 2,
    corpus: bytes | TokenData | None = None,
    added_latency_s: float = 0.0,
    evaluate_every_round: bool = False,
    timeout_s: float = 1800.0,
    track_deficit: bool = False,
    on_round: Callable[[AggregatorClient, RoundReport], None] | None = None,
    before_stop: Callable[[list[str]], None] | None = None,
    keep_rounds: int = DEFAULT_KEEP_ROUNDS,
    update_check: UpdateCheckConfig | None = None,
    push_fault: PushFault | None = None,
    before_start: Callable[[list[Shard]], None] | None = None,
    aggregate: AggregateConfig | None = None,
) -> InProcessResult:
    """Train `config.rounds` rounds with `num_clusters` clusters against `num_shards` shards.

    `track_deficit`: the clusters' compressors keep what they withheld (benchmarks read it);
    `on_round(client, report)`: called by each cluster's thread after each of its rounds;
    `before_stop(addresses)`: called once the clusters are done, while the shards still serve;
    `keep_rounds`: the versions whose contributions the shards keep (server/rounds/recent_rounds.py);
    `update_check`: the shards' check of each site's update (server/checks/update_check.py; None: the shard's default);
    `push_fault(cluster, round, slice)`: every cluster's pushed slices go through it (sim/push_fault.py: a
    drill's faulty site, `dilocox bench faults`); None: plain clients;
    `before_start(shards)`: called once the shards serve, before any cluster starts (a benchmark instruments them);
    `aggregate`: the shards' mean or clipped mean (server/checks/robust_mean.py; None: the plain mean)."""
    corpus = corpus if corpus is not None else load_corpus(None)
    shards = [
        Shard(
            i,
            num_shards,
            config.run_id,
            config.outer.lr,
            config.outer.momentum,
            min_clusters=num_clusters,
            keep_rounds=keep_rounds,
            update_check=update_check,
            aggregate=aggregate,
        )
        for i in range(num_shards)
    ]
    servers, addresses = [], []
    for shard in shards:
        server, port = start_server(shard, "127.0.0.1", 0, config.wire, added_latency_s=added_latency_s)
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    clusters = []
    try:
        if before_start is not None:
            before_start(shards)
        for i in range(num_clusters):
            trainer = InnerTrainer(config, corpus, i, num_clusters)
            compressor = (
                TensorCompressor(config.compress, seed=config.seed, track_deficit=track_deficit)
                if config.compress.codec != "fp32"
                else None
            )
            faulty = {"fault": push_fault} if push_fault is not None else {}
            client = (FaultyPushClient if faulty else AggregatorClient)(
                addresses,
                config.run_id,
                f"cluster-{i}",
                config.wire,
                compressor=compressor,
                stale_weighting=config.stale_weighting,
                connect_timeout=30,
                rpc_timeout=max(60.0, timeout_s),
                **faulty,
            )
            hook = (lambda report, _steps, _version, client=client: on_round(client, report)) if on_round else None
            clusters.append(
                DilocoCluster(
                    trainer,
                    client,
                    config.rounds,
                    config.inner.steps,
                    config.delay,
                    json.dumps(as_dict(config)),
                    evaluate_every_round=evaluate_every_round,
                    on_round=hook,
                    sync_rounds=config.sync_rounds,
                    delayed_start=config.delayed_start,
                    overlap_steps=config.overlap_steps,
                    num_clusters=num_clusters,
                )
            )
        errors: list[BaseException] = []

        def run(cluster: DilocoCluster) -> None:
            try:
                cluster.run()
            except BaseException as error:  # noqa: BLE001 - re-raised below
                errors.append(error)

        # Daemon threads, waited for together: once one cluster fails, the others may wait for a round that
        # never closes; the run raises then, and what is left of them cannot keep the process alive.
        threads = [threading.Thread(target=run, args=(c,), name=c.client.cluster, daemon=True) for c in clusters]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            while t.is_alive() and not errors and time.monotonic() < deadline:
                t.join(timeout=0.2)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"in-process run did not finish within {timeout_s:.0f}s")
        if before_stop is not None:
            before_stop(addresses)
        return InProcessResult(clusters, shards, sum(p.numel() for _, p in clusters[0].trainer.named_parameters()))
    finally:
        for c in clusters:
            c.client.close()
        # Wait until each server's loop thread is down: a process that exits while one is still stopping
        # dies in C++ ("terminate called without an active exception", SIGABRT: 1 run in 6-8 of
        # `bench compression` before).
        for stopped in [server.stop(grace=None) for server in servers]:
            stopped.wait(timeout=30)
