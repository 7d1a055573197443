"""`dilocox bench <name>`: run one benchmark (or all) and write its report."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "wire": ("dilocox.bench.wire", "bytes per round: DiLoCoX vs dense fp32 vs AllReduce"),
    "compression": (
        "dilocox.bench.compression",
        "bytes on the wire vs final eval loss per compression setting, against dense synchronous DiLoCo",
    ),
    "overlap": ("dilocox.bench.overlap", "compute idle time with and without the one-step delay over a slow link"),
    "pipeline": ("dilocox.bench.pipeline", "inner-step tokens/s of a PP=2 cluster vs one process"),
    "train": (
        "dilocox.bench.train",
        "trainer tokens/s and peak memory per model preset and precision; streaming a large token file",
    ),
    "speed": (
        "dilocox.bench.site_speed",
        "a site's tokens/s, MFU and peak memory against a plain torch loop of the same model, batch and data",
    ),
    "wan": (
        "dilocox.bench.wan",
        "DiLoCoX vs DiLoCo vs AllReduce over shaped WAN links (namespaces + tc), report and plots",
    ),
    "shard": (
        "dilocox.bench.shard_throughput",
        "MB/s of pseudo-gradients decoded and applied per shard vs memory bandwidth",
    ),
    "scale": (
        "dilocox.bench.scale",
        "the aggregation service at model size: time and memory per round against parameters, clusters and shards",
    ),
    "gpu": (
        "dilocox.bench.gpu",
        "the first thing to run on a GPU machine: a site (sim, pp, FSDP2 dp, accumulation, resume) on its GPUs",
    ),
    "load": (
        "dilocox.bench.load",
        "many clusters (32 to 256) against 2 shards: rounds/s, round latency, shard RSS and CPU, refusals",
    ),
    "exchange": (
        "dilocox.bench.exchange",
        "CPU cost of a round's exchange per stage (ns/parameter) against same-run rooflines, and training beside it",
    ),
    "uneven": (
        "dilocox.bench.uneven",
        "one site 2×/4× slower: fixed H vs time-boxed rounds vs quorum + grace (idle share, tokens/s, loss curves)",
    ),
    "resume": (
        "dilocox.bench.resume",
        "WAN bytes of a site's restart k rounds behind (replayed on its checkpoint's replica) against a full pull; "
        "107B projected",
    ),
    "faults": (
        "dilocox.bench.faults",
        "one faulty site (×100, sign flip, noise, bit flips, stale replay) against the shards' update check: damage, "
        "detection, false alarms",
    ),
    "projection": (
        "dilocox.bench.projection",
        "DiLoCoX at OPT-1.3B and 107B over 1 Gbit/s, projected from a `bench scale` report",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--out", help="results folder (default bench/results/<timestamp>)")
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from dilocox.bench.report import results_dir
    from dilocox.common.logs import configure_logging

    configure_logging("kv", "warning")
    out_dir = results_dir(args.out)
    text = importlib.import_module(BENCHMARKS[args.benchmark][0]).run(args, out_dir)
    print(text)
    print(f"written to {out_dir}")
    return 0
