"""`dilocox bench load`: many clusters against 2 real shard processes — does a round still close with
every cluster, and how does its latency grow?

Each cluster is a raw `AggregatorClient` in a thread of this process (a tiny model: the shards' work per
round is negligible, so what is measured is the service's handling of many concurrent calls): per
round every cluster pushes, then long-polls its pull until the round's version exists. Per row: rounds
per second, the median and worst round latency (first push sent → last pull answered), the shards' RSS
and CPU seconds per round (from /proc), and refused calls. With the old thread-pool server, a round
stalled for a pull's whole wait once more than 32 pulls were waiting (48 clusters: 10 s per round;
64: 60 s).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from dilocox.bench.site_layouts import process_usage, shard_pids, shard_processes
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError

PARAMS = [("w", (64, 16)), ("b", (64,))]
RUN = "bench-load"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--clusters", default="32,64,128,256", help="comma-separated cluster counts (default 32,64,128,256)"
    )
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per count, after one warm-up (default 10)")
    parser.add_argument("--pull-wait-s", type=float, default=30.0, help="each pull's long-poll wait (default 30)")
    parser.add_argument(
        "--wan-mbit",
        type=float,
        default=0.0,
        help="pace every site's push and pull to a link of this many Mbit/s, so that hundreds of pushes are in "
        "transit at once (bench/load_wan.py); 0: as fast as localhost goes (default)",
    )
    parser.add_argument(
        "--push-kb",
        type=int,
        default=256,
        help="with --wan-mbit: each site's compressed push to each shard (default 256)",
    )
    parser.add_argument(
        "--stalled",
        type=int,
        default=20,
        help="with --wan-mbit: push streams per shard that stall after one chunk (default 20)",
    )
    parser.add_argument(
        "--pull-cache-mb",
        default="",
        help="with --wan-mbit: the shards' --pull-cache-mb, comma-separated to compare in one run (e.g. 0,512: "
        "each pull framing its own chunks against one framing shared; default: the shards' default)",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=2,
        help="with --wan-mbit: shard processes, each sent --push-kb by every site (default 2; 1 leaves the other core "
        "of a 2-core machine to the simulated sites)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="with --wan-mbit: each shard process on a core of its own and the simulated sites on the cores left, "
        "as on machines of their own (needs --shards + 1 cores)",
    )


def measure(clusters: int, rounds: int, pull_wait_s: float) -> dict:
    refused = 0
    with (
        tempfile.TemporaryDirectory(prefix="dilocox-load-") as tmp,
        shard_processes(2, RUN, pathlib.Path(tmp)) as addresses,
    ):
        pids = [int(pid) for pid in shard_pids(addresses)]
        clients = [
            AggregatorClient(addresses, RUN, f"c{i}", connect_timeout=60, rpc_timeout=600) for i in range(clusters)
        ]
        pool = ThreadPoolExecutor(max_workers=clusters)
        try:
            clients[0].join(PARAMS)  # the initialiser: the first to join
            list(pool.map(lambda c: c.join(PARAMS), clients[1:]))
            theta = {s.key: torch.zeros(s.slice_shape) for s in clients[0].assignment}
            clients[0].push(0, 1.0, theta)
            list(pool.map(lambda c: c.pull(0, wait_seconds=pull_wait_s), clients))
            latencies = []
            cpu_before = None
            for round_ in range(1, rounds + 2):
                if round_ == 2:
                    cpu_before, started_all = [process_usage(p)[1] for p in pids], time.perf_counter()
                started = time.perf_counter()

                def one(c: AggregatorClient, round_=round_) -> int:
                    try:
                        c.push(round_, 1.0, {k: torch.full_like(t, 0.001) for k, t in theta.items()})
                        c.pull(round_, wait_seconds=pull_wait_s)
                        return 0
                    except AggregatorError:
                        return 1

                refused += sum(pool.map(one, clients))
                if round_ >= 2:
                    latencies.append(time.perf_counter() - started)
            elapsed = time.perf_counter() - started_all
            usage = [process_usage(p) for p in pids]
        finally:
            pool.shutdown()
            for c in clients:
                c.close()
    cpu = sum(u[1] - b for u, b in zip(usage, cpu_before or [0.0] * len(usage)))
    return {
        "clusters": clusters,
        "rounds_per_s": round(rounds / elapsed, 2),
        "round_latency_median_s": round(statistics.median(latencies), 3),
        "round_latency_max_s": round(max(latencies), 3),
        "shard_rss_mb": [round(u[0]) for u in usage],
        "shard_cpu_s_per_round": round(cpu / rounds, 4),
        "refused_calls": refused,
    }


def run(args: argparse.Namespace, out_dir) -> str:
    from dilocox.bench.report import write_report

    if args.wan_mbit > 0:
        if args.shards < 1:
            raise SystemExit(f"dilocox bench load: --shards must be ≥ 1, got {args.shards}")
        if args.pin:
            from dilocox.bench.load_wan import pinnable_cores

            try:
                pinnable_cores(args.shards)
            except ValueError as error:
                raise SystemExit(f"dilocox bench load: {error}") from None
        return _run_wan(args, out_dir)
    rows = [measure(int(n), args.rounds, args.pull_wait_s) for n in args.clusters.split(",") if n.strip()]
    notes = (
        f"2 shard processes on localhost; every cluster an AggregatorClient thread in one process (a tiny model); "
        f"{args.rounds} timed rounds after a warm-up; pulls long-poll up to {args.pull_wait_s:g} s; {os.cpu_count()} "
        "CPU cores. "
        "Round latency: from the round's first push to its last pull's answer.\n"
    )
    columns = [
        "clusters",
        "rounds_per_s",
        "round_latency_median_s",
        "round_latency_max_s",
        "shard_rss_mb",
        "shard_cpu_s_per_round",
        "refused_calls",
    ]
    return write_report(out_dir, "load", "Many clusters against 2 shards", rows, columns, notes, {"args": vars(args)})


def _run_wan(args: argparse.Namespace, out_dir) -> str:
    from dilocox.bench.load_wan import measure as measure_wan
    from dilocox.bench.report import write_report

    caches = [int(c) for c in args.pull_cache_mb.split(",") if c.strip()] or [None]
    rows = [
        measure_wan(int(n), args.rounds, args.wan_mbit, args.push_kb, args.stalled, cache, args.shards, args.pin)
        for n in args.clusters.split(",")
        if n.strip()
        for cache in caches
    ]
    notes = (
        f"{args.shards} shard process(es) on localhost; every site a raw grpc.aio client, a coroutine on one event "
        f"loop of one process, its push ({args.push_kb} KB a "
        f"shard, framed as the real client frames it) and its pull (the weights) paced to {args.wan_mbit:g} Mbit/s; "
        f"{args.stalled} push streams per shard stall after one chunk; {args.rounds} rounds; Status polled from every "
        "shard "
        f"every 0.25 s; {os.cpu_count()} CPU "
        f"cores{'; each shard pinned to a core of its own, the sites to the rest' if args.pin else ''}. "
        "link_s: the push and the pull at the link's rate alone.\n"
    )
    columns = [
        "sites",
        "shards",
        "mbit",
        "stalled_streams",
        "push_kb_per_shard",
        *(["pull_cache_mb"] if args.pull_cache_mb else []),
        "link_s",
        "round_latency_median_s",
        "round_latency_max_s",
        "status_median_s",
        "status_max_s",
        "status_calls",
        "one_shard_cpu_ms_per_site_round",
        "cpu_s_per_round",
        "pinned",
    ]
    return write_report(
        out_dir,
        "load_wan",
        f"Sites at WAN pace against {args.shards} shard(s), beside stalled pushes",
        rows,
        columns,
        notes,
        {"args": vars(args)},
    )
