"""`dilocox bench projection`: DiLoCoX at the paper's sizes, projected from costs measured here.

Nothing here trains or sends anything. Bytes per round are exact: the default compressor's payload sizes
(low rank at the rank error feedback keeps it at, int4 factors; small and 1-D tensors int4) for every
slice of the model's parameter list as the service would cut it. Times come from a `dilocox bench
exchange` report (each stage's CPU per parameter on one thread: what a rank spends on its own share) or
a `dilocox bench scale` report (the wall times of its largest default-compression row whose clusters all
replay, contended by everything else on the machine) and from the assumptions printed with the table: sites, link rate,
one inner step's time T, and the cores a
cluster and a shard give to the exchange.

The comparison is the paper's: AllReduce sends every step's fp32 gradients across the WAN (a ring over
M sites moves 2(M−1)/M of the model per step through each site's link), DiLoCoX sends one compressed
pseudo-gradient per H steps and overlaps it with the next round's compute (one-step delay), so once the
round's communication fits inside H·T its step costs T and the throughput ratio is (T + t_allreduce) / T.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

from dilocox.bench.report import write_report
from dilocox.common.wire.assignment import assign_slices
from dilocox.common.wire.compression import CompressionConfig
from dilocox.common.wire.lowrank import as_matrix_shape, lowrank_nbytes
from dilocox.common.wire.quantize import quantized_nbytes


def opt_1_3b() -> list[tuple[str, tuple[int, ...]]]:
    """OPT-1.3B's parameters (24 layers, d 2048, FFN 8192, vocab 50272, learned positions, tied head)."""
    d, ffn = 2048, 8192
    specs = [("embed_tokens", (50272, d)), ("embed_positions", (2050, d))]
    for i in range(24):
        p = f"layers.{i}."
        for proj in ("q", "k", "v", "out"):
            specs += [(p + f"{proj}_proj.weight", (d, d)), (p + f"{proj}_proj.bias", (d,))]
        specs += [(p + "attn_norm.weight", (d,)), (p + "attn_norm.bias", (d,))]
        specs += [
            (p + "fc1.weight", (ffn, d)),
            (p + "fc1.bias", (ffn,)),
            (p + "fc2.weight", (d, ffn)),
            (p + "fc2.bias", (d,)),
        ]
        specs += [(p + "ffn_norm.weight", (d,)), (p + "ffn_norm.bias", (d,))]
    return specs + [("final_norm.weight", (d,)), ("final_norm.bias", (d,))]


def _llama(d: int, kv: int, ffn: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-shaped parameter list: untied head, grouped KV, SwiGLU FFN, RMS norms."""
    specs = [("embed_tokens", (vocab, d))]
    for i in range(layers):
        p = f"layers.{i}."
        specs += [(p + "q_proj", (d, d)), (p + "k_proj", (kv, d)), (p + "v_proj", (kv, d)), (p + "o_proj", (d, d))]
        specs += [(p + "gate_proj", (ffn, d)), (p + "up_proj", (ffn, d)), (p + "down_proj", (d, ffn))]
        specs += [(p + "attn_norm", (d,)), (p + "ffn_norm", (d,))]
    return specs + [("norm", (d,)), ("lm_head", (vocab, d))]


def dense_107b() -> list[tuple[str, tuple[int, ...]]]:
    """A Llama-shaped stand-in of the paper's 107B model (its card is not in our references): d 8192,
    64 heads with 8 KV heads, FFN 28672, 122 layers, vocab 152064, untied head — 106.9B parameters."""
    return _llama(8192, 1024, 28672, 122, 152064)


def llama_3_70b() -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-70B's shapes (its published config.json): d 8192, 8 KV heads of 128, FFN 28672, 80 layers,
    vocab 128256 — 70.6B parameters."""
    return _llama(8192, 1024, 28672, 80, 128256)


MODELS = {"opt-1.3b": opt_1_3b, "llama-3-70b": llama_3_70b, "dense-107b": dense_107b}


def compressed_bytes(specs, shards: int, config: CompressionConfig | None = None) -> int:
    """One cluster's uplink per round with the default compressor at its highest rank, slice by slice."""
    config = config or CompressionConfig()
    total = 0
    for s in assign_slices(specs, shards):
        shape = s.slice_shape
        if len(shape) >= 2 and math.prod(shape) >= config.min_lowrank_numel:
            rows, cols = as_matrix_shape(shape)
            rank = min(config.rank_max, rows, cols)
            total += lowrank_nbytes(rows, cols, rank, config.factor_bits)
        else:
            total += quantized_nbytes(math.prod(shape), config.factor_bits)
    return total


def measured_costs(report: pathlib.Path) -> dict:
    """Per-parameter costs from a `bench scale` report: its largest default-compression row with error
    feedback on (a push-only cluster compresses as a full one does; only a full one replays, and the
    replay is timed on it)."""
    rows = [
        r for r in json.loads(report.read_text())["rows"] if r["codec"] == "default" and r.get("error_feedback", True)
    ]
    if not rows:
        raise SystemExit(f"{report}: no default-compression row with error feedback")
    row = max(rows, key=lambda r: (r["params_M"], -r["M"]))
    params = row["params_M"] * 1e6
    return {
        "from": f"{row['model']} ({row['params_M']}M), M={row['M']}, N={row['N']}",
        "compress_s_per_param": row["compress_s"] / params,
        "replay_s_per_param": row["pull_replay_s"] / params,
        "shard_dense_bytes_per_s": row["decode_apply_MB_s"] * 1e6,
        "shard_rss_vs_owned": row["shard_rss_vs_owned"],
    }


def exchange_costs(report: pathlib.Path, rss_vs_owned: float) -> dict:
    """Per-parameter costs from a `dilocox bench exchange` report, one thread: a cluster's compress side
    (Δ, compress with error feedback, frame) and its replay side (vet, replay of the M contributions,
    replay check), and the shard's fused close of M fp32 contributions, as contribution bytes per second.
    The shard's memory is not in that report: `rss_vs_owned` (bench scale's figure) stands for it."""
    data = json.loads(report.read_text())
    ns = {row["stage"]: row["ns_per_param"] for row in data["rows"] if row["threads"] == 1}
    missing = [
        s
        for s in ("pseudo_gradient", "compress_ef", "frame_zstd", "vet", "replay", "replay_check", "shard_close")
        if s not in ns
    ]
    if missing:
        raise SystemExit(f"{report}: no one-thread figures for {missing} (run `dilocox bench exchange --threads 1,…`)")
    m = int(data.get("meta", {}).get("clusters", 2))  # contributions in the timed replay and close
    return {
        "from": f"bench exchange, one thread, M={m}",
        "compress_s_per_param": (ns["pseudo_gradient"] + ns["compress_ef"] + ns["frame_zstd"]) * 1e-9,
        "replay_s_per_param": (ns["vet"] + ns["replay"] + ns["replay_check"]) * 1e-9,
        "shard_dense_bytes_per_s": 4 * m / (ns["shard_close"] * 1e-9),
        "shard_rss_vs_owned": rss_vs_owned,
    }


def project(name: str, specs, step_s: float, costs: dict, args: argparse.Namespace) -> dict:
    params = sum(math.prod(s) for _, s in specs)
    fp32 = 4 * params
    rate = args.link_gbit * 1e9 / 8
    sites = args.sites
    up = compressed_bytes(specs, args.shards)
    down = (sites - 1) * up  # the other sites' contributions, forwarded; own part as a digest
    send_s = max(up, down) / rate  # a full-duplex link: up and down at once
    cpu_s = (costs["compress_s_per_param"] + costs["replay_s_per_param"]) * params / args.cluster_cores
    shard_close_s = sites * fp32 / args.shards / (costs["shard_dense_bytes_per_s"] * args.shard_cores)
    round_s = send_s + cpu_s + shard_close_s  # what the next round's compute must cover
    allreduce_s = 2 * (sites - 1) / sites * fp32 / rate
    # The fewest shards whose close takes no longer than a cluster's own part of the exchange (send +
    # CPU; beyond that the service, not the clusters, sets the exchange's time) and whose state fits.
    by_time = math.ceil(shard_close_s * args.shards / (send_s + cpu_s))
    by_memory = math.ceil(costs["shard_rss_vs_owned"] * fp32 / (args.shard_ram_gb * 1e9))
    return {
        "model": name,
        "params_B": round(params / 1e9, 2),
        "fp32_GB": round(fp32 / 1e9, 1),
        "up_MB": round(up / 1e6, 1),
        "down_MB": round(down / 1e6, 1),
        "compression_x": round(fp32 / up),
        "send_s": round(send_s, 2),
        "cluster_cpu_s": round(cpu_s, 1),
        "shard_close_s": round(shard_close_s, 2),
        "step_T_s": step_s,
        "H_hides": math.ceil(round_s / step_s),
        "shards_needed": max(by_time, by_memory),
        "allreduce_step_s": round(step_s + allreduce_s, 1),
        "ratio_vs_allreduce": round((step_s + allreduce_s) / step_s, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scale-report",
        type=pathlib.Path,
        help="scale.json written by `dilocox bench scale`: the costs "
        "of its largest default-compression row, and the shard's peak memory per owned byte",
    )
    parser.add_argument(
        "--exchange-report",
        type=pathlib.Path,
        help="exchange.json written by `dilocox bench exchange`: per-stage costs on one thread, which "
        "replace the scale report's (its memory figure is kept where given)",
    )
    parser.add_argument(
        "--shard-rss-vs-owned",
        type=float,
        default=3.6,
        help="with --exchange-report alone: a shard's peak memory per owned fp32 byte (default 3.6, "
        "bench scale's llama-350m row)",
    )
    parser.add_argument(
        "--step-s",
        default="opt-1.3b=4,dense-107b=10",
        help="assumed seconds of one inner step per model (default opt-1.3b=4,dense-107b=10)",
    )
    parser.add_argument("--sites", type=int, default=2, help="clusters (sites), one per WAN link (default 2)")
    parser.add_argument(
        "--link-gbit", type=float, default=1.0, help="each site's WAN rate, each way (default 1 Gbit/s)"
    )
    parser.add_argument("--shards", type=int, default=4, help="shards the bytes are cut for (default 4)")
    parser.add_argument("--cluster-cores", type=int, default=16, help="cores a cluster's exchange uses (default 16)")
    parser.add_argument("--shard-cores", type=int, default=4, help="cores each shard uses (default 4)")
    parser.add_argument(
        "--shard-ram-gb", type=float, default=256.0, help="memory of one shard's machine (default 256 GB)"
    )


def run(args: argparse.Namespace, out_dir) -> str:
    if args.scale_report is None and args.exchange_report is None:
        raise SystemExit(
            "dilocox bench projection: give --exchange-report (bench exchange) or --scale-report (bench scale)"
        )
    rss = measured_costs(args.scale_report)["shard_rss_vs_owned"] if args.scale_report else args.shard_rss_vs_owned
    costs = exchange_costs(args.exchange_report, rss) if args.exchange_report else measured_costs(args.scale_report)
    source = args.exchange_report or args.scale_report
    steps = dict((k, float(v)) for k, v in (item.split("=") for item in args.step_s.split(",")))
    rows = [project(name, MODELS[name](), steps[name], costs, args) for name in MODELS if name in steps]
    notes = (
        f"Measured costs from {costs['from']} (`{source}`), one core each on a shared 2-core machine: "
        f"compress {costs['compress_s_per_param'] * 1e9:.1f} ns and pull + replay "
        f"{costs['replay_s_per_param'] * 1e9:.1f} ns per "
        f"parameter per cluster; a shard decodes and applies {costs['shard_dense_bytes_per_s'] / 1e6:.0f} MB/s of "
        "dense fp32 "
        f"contributions; shard peak RSS {costs['shard_rss_vs_owned']}× owned. Assumed: {args.sites} sites, "
        f"{args.link_gbit} Gbit/s "
        f"each way, {args.shards} shards for the byte count, {args.cluster_cores} cores per cluster and "
        f"{args.shard_cores} per shard "
        f"for the exchange (times divided accordingly), {args.shard_ram_gb:.0f} GB per shard machine, inner step T as "
        "given. "
        "`up_MB`: one cluster's push per round at rank 8 with int4 factors (error feedback keeps the rank at its "
        "maximum); "
        "`down_MB`: the other sites' pushes, forwarded. `H_hides`: the smallest H for which send + cluster CPU + "
        "shard close "
        "fit in one round of compute (one-step delay). `shards_needed`: the fewest shards whose close takes no longer "
        "than a cluster's send + CPU and whose "
        "state (peak RSS / owned as measured) fits a shard machine. `ratio_vs_allreduce`: (T + ring AllReduce of fp32 "
        "gradients) / T, DiLoCoX's step costing T "
        "once H ≥ H_hides (its loss is docs/performance.md's 'The loss gap', not this table's).\n"
    )
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "costs": costs}
    return write_report(
        out_dir, "projection", "DiLoCoX at the paper's sizes, projected", rows, list(rows[0]), notes, meta
    )
