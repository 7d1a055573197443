"""`dilocox bench overlap`: compute idle time with and without the one-step delay over a slow link.

Shards add a fixed latency to every push and pull (user-space, as this kernel has no netem); the
clusters train the default model. With delay 0 each round waits for its push and pull; with delay 1
the exchange travels while the next round computes and the trainer should (almost) never wait.
"""

from __future__ import annotations

import argparse
import time

from dilocox.bench.report import write_report
from dilocox.common.config.run import InnerConfig, RunConfig
from dilocox.sim.inprocess import run_in_process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--latency-ms", type=float, default=300.0, help="added to every push and pull (default 300)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per mode (default 6)")
    parser.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round (default 20)")


def run(args: argparse.Namespace, out_dir) -> str:
    rows = []
    for delay in (0, 1):
        config = RunConfig(rounds=args.rounds, delay=delay, inner=InnerConfig(steps=args.inner_steps))
        started = time.perf_counter()
        result = run_in_process(config, num_clusters=2, num_shards=2, added_latency_s=args.latency_ms / 1000)
        reports = result.steady_reports()
        idle = sum(r.idle_s for r in reports) / len(reports)
        seconds = sum(r.seconds for r in reports) / len(reports)
        comm = sum(r.comm_s for r in reports) / len(reports)
        rows.append(
            {
                "delay": delay,
                "round_s": round(seconds, 3),
                "compute_s": round(sum(r.compute_s for r in reports) / len(reports), 3),
                "comm_s": round(comm, 3),
                "idle_s": round(idle, 3),
                "idle_fraction": round(idle / seconds, 4),
                "overlap": round(min(1.0, max(0.0, 1 - idle / comm)), 3) if comm else 1.0,
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
    notes = (
        f"Default model, 2 clusters × 2 shards, H={args.inner_steps}, {args.rounds} rounds, {args.latency_ms:.0f} ms "
        "added "
        "to every push and every pull. Means over rounds ≥ 2 and both clusters. `comm_s`: push + pull of the exchange "
        "folded in at a boundary; `idle_s`: how long the trainer blocked on it; `overlap` = 1 − idle/comm.\n"
    )
    return write_report(
        out_dir,
        "overlap",
        "Compute idle time: one-step delay vs synchronous",
        rows,
        list(rows[0]),
        notes,
        {"args": vars(args)},
    )
