"""`dilocox bench wire`: bytes on the wire per round, DiLoCoX vs dense pseudo-gradients vs AllReduce.

Runs the default model for a few rounds in one process (real shards on localhost gRPC, two clusters on
threads) once per configuration, and reads the bytes each cluster sent and received per round at the
gRPC message layer. References: dense fp32 pseudo-gradients (the model's size, each way), and one
data-parallel ring AllReduce step, which moves 2·(N−1)/N of the model per worker — H of them per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from dilocox.bench.compression import LEAN_PRESET, PREVIOUS_DEFAULT
from dilocox.bench.report import write_report
from dilocox.common.config.run import InnerConfig, RunConfig, WireConfig
from dilocox.common.wire.compression import CompressionConfig
from dilocox.sim.inprocess import run_in_process

DEFAULT_NO_CHECK = "dilocox default, replay check off"
CONFIGS = {
    "dilocox default (rank≤8, int4, error feedback)": CompressionConfig(),
    DEFAULT_NO_CHECK: CompressionConfig(),
    "lean preset (rank≤6, int4, error feedback)": LEAN_PRESET,
    "rank≤8, int8 factors": CompressionConfig(factor_bits=8),
    "previous default (rank≤24, 95% energy, int4, no error feedback)": PREVIOUS_DEFAULT,
    "int8 quantised": CompressionConfig(codec="int8"),
    "dense fp32 (DiLoCo)": CompressionConfig(codec="fp32"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="rounds per configuration (default 5)")
    parser.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    parser.add_argument("--clusters", type=int, default=2, help="clusters pushing each round (default 2)")


def run(args: argparse.Namespace, out_dir) -> str:
    rows = []
    for label, compress in CONFIGS.items():
        wire = WireConfig(replay_check=label != DEFAULT_NO_CHECK)
        config = RunConfig(
            rounds=args.rounds, delay=0, inner=InnerConfig(steps=args.inner_steps), compress=compress, wire=wire
        )
        started = time.perf_counter()
        result = run_in_process(config, num_clusters=args.clusters, num_shards=2)
        dense = 4 * result.num_params
        up, down = result.bytes_per_round()
        allreduce_round = 2 * (args.clusters - 1) / args.clusters * dense * args.inner_steps
        rows.append(
            {
                "config": label,
                "up_bytes_per_round": round(up),
                "down_bytes_per_round": round(down),
                "up_vs_dense_fp32": round(dense / up, 1),
                "down_vs_dense_fp32": round(dense / down, 1),
                "vs_allreduce_per_round": round(2 * allreduce_round / (up + down), 1),
                "final_eval_loss": round(result.mean_final_eval_loss(), 4),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    with_check, without = rows[0]["down_bytes_per_round"], rows[1]["down_bytes_per_round"]
    notes = (
        f"Replay check: the shards' state digests add {with_check - without} bytes per cluster per round to the "
        f"downlink ({100 * (with_check - without) / without:.2f} % of {without}; 2 shards).\n"
        f"Default model ({result.num_params:,} parameters, dense fp32 = {4 * result.num_params:,} bytes), "
        f"{args.clusters} clusters, 2 shards, H={args.inner_steps}, {args.rounds} rounds, synchronous. Bytes per "
        "cluster "
        "per round (rounds ≥ 2), counted at the gRPC message layer (ByteSize of every message), including "
        "framing. `vs_allreduce_per_round`: one ring AllReduce per inner step (2·(N−1)/N of the model each "
        "way per worker), over H steps, divided by DiLoCoX's up+down bytes per round.\n"
    )
    return write_report(
        out_dir,
        "wire",
        "Bytes on the wire per round",
        rows,
        list(rows[0]),
        notes,
        {"args": vars(args), "configs": {k: dataclasses.asdict(v) for k, v in CONFIGS.items()}},
    )
