"""`dilocox bench wan`: DiLoCoX vs DiLoCo vs data-parallel AllReduce over shaped WAN links, on one machine.

Each site runs in its own network namespace, joined to a hub (the aggregation shards) by a veth pair that
`tc tbf` limits to the link rate in both directions (bench/netns.py); latency and jitter are added in user
space (no netem here). Without namespaces (not root, restricted sandbox) it says so and falls back to a
token-bucket throttle in a relay on the gRPC byte streams (bench/wan_links.py), labelled in the report.

Every mode trains the same model on the same data shards for the same tokens (rounds × H × batch ×
sites). Scaling: the small CPU model must see the communication-to-compute ratio of a large model on
1 Gbit/s, so the default link rate is derived from the measured step time (bench/wan_calibration.py; see
`scaling_note` in bench/wan_report.py, which writes the report).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import signal
import sys
import time

from dilocox.bench import netns
from dilocox.bench.wan_calibration import allreduce_link_s, auto_rate_mbit, calibrate
from dilocox.bench.wan_links import LinkSettings, LoopbackLinks, NamespaceLinks, measure_links
from dilocox.bench.wan_modes import ABLATIONS, ALL_MODES, MODES, ModeResult
from dilocox.bench.wan_ratio import (
    DEFAULT_SHAPED_STEPS,
    SPLIT_FROM_RATIO,
    join_split,
    paper_regime,
    shaped_probe_config,
    unshaped_links,
)
from dilocox.bench.wan_report import ratio_lines, write_wan_report
from dilocox.bench.wan_runs import RUNNERS, RunOptions
from dilocox.common.config.run import InnerConfig, RunConfig
from dilocox.common.config.run_flags import add_config_arguments, config_from_args
from dilocox.worker.data.token_data import load_run_data

DEFAULT_ROUNDS, QUICK_ROUNDS = 10, 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds instead of {DEFAULT_ROUNDS}, shorter link probes"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, any of {', '.join(MODES)} (the default) and the ablations {', '.join(ABLATIONS)}",
    )
    parser.add_argument("--sites", type=int, default=2, help="sites (clusters), each in its own namespace (default 2)")
    parser.add_argument("--shards", type=int, default=2, help="aggregation shards, in the hub (default 2)")
    parser.add_argument(
        "--rate-mbit",
        type=float,
        default=0.0,
        help="link rate per direction in Mbit/s; 0 (default) derives it from --comm-ratio and the measured step time",
    )
    parser.add_argument(
        "--comm-ratio",
        type=float,
        default=20.0,
        help="AllReduce time / compute time of one step on the link (default 20: a large model on 1 Gbit/s)",
    )
    parser.add_argument(
        "--paper-model",
        help="take the ratio from this model on the link instead: opt-1.3b or dense-107b "
        "(r = its ring AllReduce bytes per site / link rate / --step-s)",
    )
    parser.add_argument(
        "--link-gbit", type=float, default=1.0, help="with --paper-model: the WAN link between the sites (default 1)"
    )
    parser.add_argument(
        "--step-s",
        type=float,
        help="with --paper-model: one inner step's compute at a site (default 4 s for opt-1.3b, 10 s for dense-107b)",
    )
    parser.add_argument(
        "--gradient-bytes",
        type=int,
        default=4,
        help="with --paper-model: bytes per AllReduced gradient value, 4 (fp32, default) or 2",
    )
    parser.add_argument(
        "--allreduce-steps",
        type=int,
        default=-1,
        help=f"measure AllReduce's throughput over this many shaped steps and take its loss curve from an unshaped "
        f"run (the numerics do not depend on the link); 0: run it shaped in full; default: {DEFAULT_SHAPED_STEPS} "
        f"when r > {SPLIT_FROM_RATIO:g}, else 0",
    )
    parser.add_argument(
        "--latency-ms", type=float, default=2.0, help="one-way link latency, added in user space (default 2)"
    )
    parser.add_argument("--jitter-ms", type=float, default=0.5, help="uniform ± jitter on the latency (default 0.5)")
    parser.add_argument(
        "--target-loss", type=float, help="eval loss for the time-to-target column (default: the worst final loss)"
    )
    parser.add_argument(
        "--fallback", action="store_true", help="use the in-process throttle even where namespaces work"
    )
    parser.add_argument(
        "--probe-seconds", type=float, help="bulk-transfer probe length per path (default 3; --quick 2)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per site process (default 1)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up on a mode after this many seconds")
    parser.add_argument("--data", help="text file or folder to train on (default: the bundled tinyshakespeare)")
    add_config_arguments(parser)


def base_config(args: argparse.Namespace) -> RunConfig:
    rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    config = config_from_args(args, RunConfig(run_id="dilocox-bench-wan", rounds=rounds, inner=InnerConfig(steps=50)))
    if config.parallel.world_size > 1:
        raise SystemExit("dilocox bench wan: the AllReduce baseline runs one process per site; use --pp 1 --dp 1")
    return config


class Bars:
    """A tqdm bar per mode on stderr when it is a terminal (and tqdm is installed); one line per mode otherwise."""

    def __init__(self) -> None:
        try:
            import tqdm
        except ImportError:
            tqdm = None
        self.tqdm = tqdm.tqdm if tqdm is not None and sys.stderr.isatty() else None

    def start(self, name: str, total: int, unit: str):
        if self.tqdm is None:
            print(f"[bench wan] {name}: running ({total} {unit}s)…", file=sys.stderr, flush=True)
            return None, lambda n, fields: None
        width = shutil.get_terminal_size((100, 20)).columns
        bar = self.tqdm(
            total=total, desc=f"{name:>10}", unit=unit, file=sys.stderr, leave=True, ncols=width if width >= 40 else 100
        )
        return bar, lambda n, fields: (bar.update(n), bar.set_postfix(fields, refresh=False))

    @staticmethod
    def finish(bar, name: str, text: str) -> None:
        if bar is not None:
            bar.close()
        print(f"[bench wan] {name}: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, out_dir: pathlib.Path) -> str:
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally blocks tear the namespaces down
    try:
        return _run(args, out_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, out_dir: pathlib.Path) -> str:
    started = time.monotonic()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise SystemExit(f"dilocox bench wan: unknown mode(s) {unknown}; known: {', '.join(ALL_MODES)}")
    if args.sites < 2 or args.shards < 1:
        raise SystemExit("dilocox bench wan: needs --sites ≥ 2 and --shards ≥ 1")
    config = base_config(args)
    data = load_run_data(config.tokenizer, args.data)  # trains and caches a bpe:VOCAB tokenizer before the sites start
    calibration = calibrate(config, data, args.sites, args.threads)
    regime = (
        paper_regime(args.paper_model, args.sites, args.link_gbit, args.step_s, args.gradient_bytes)
        if args.paper_model
        else None
    )
    args.comm_ratio = regime.ratio if regime else args.comm_ratio
    rate = args.rate_mbit if args.rate_mbit > 0 else auto_rate_mbit(calibration, args.comm_ratio)
    expected_ratio = allreduce_link_s(calibration, rate) / calibration["step_s"]
    split_steps = (
        args.allreduce_steps
        if args.allreduce_steps >= 0
        else (DEFAULT_SHAPED_STEPS if expected_ratio > SPLIT_FROM_RATIO else 0)
    )
    if regime:
        print(f"[bench wan] {regime.describe()}", file=sys.stderr, flush=True)
    settings = LinkSettings(rate, args.latency_ms, args.jitter_ms)
    if args.fallback:
        usable, why = False, "--fallback was given"
    else:
        usable, why = netns.available()
    if not usable:
        print(
            f"[bench wan] network namespaces unavailable ({why}): using the IN-PROCESS FALLBACK throttle",
            file=sys.stderr,
        )
    links = NamespaceLinks(args.sites, settings) if usable else LoopbackLinks(args.sites, settings, why)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    probe_s = args.probe_seconds or (2.0 if args.quick else 3.0)
    results: dict[str, ModeResult] = {}
    failures: dict[str, str] = {}
    bars = Bars()
    with links:
        describe = links.describe()
        print(
            f"[bench wan] links: {links.kind}, {rate:g} Mbit/s per direction, {args.latency_ms:g} ± "
            f"{args.jitter_ms:g} ms; probing…",
            file=sys.stderr,
            flush=True,
        )
        probes = measure_links(links, log_dir, seconds=probe_s, warmup_s=min(1.0, probe_s / 3))
        for name in modes:
            mode = ALL_MODES[name]
            mode_config = mode.config(config)
            bar, progress = bars.start(name, mode_config.rounds, "round")
            options = RunOptions(log_dir, args.timeout, args.threads, args.shards, args.data)
            try:
                if mode.runner == "allreduce" and split_steps > 0:
                    result = run_split_allreduce(links, mode, mode_config, options, progress, split_steps)
                else:
                    result = RUNNERS[mode.runner](links, mode, mode_config, options, progress)
            except Exception as error:  # noqa: BLE001 - reported, the other modes still run
                failures[name] = str(error)
                bars.finish(bar, name, f"FAILED: {str(error).splitlines()[0]}")
                continue
            results[name] = result
            bars.finish(
                bar,
                name,
                f"{result.tokens_per_s:,.0f} tokens/s, final eval loss {result.final_eval_loss:.4f}, "
                f"{result.train_s:.1f}s training",
            )
    ratios = ratio_lines(results, calibration, settings, regime)
    text = write_wan_report(
        out_dir,
        args,
        config,
        calibration,
        settings,
        describe,
        probes,
        results,
        failures,
        time.monotonic() - started,
        regime,
        ratios,
    )
    for line in ratios:
        print(f"[bench wan] {line}", file=sys.stderr, flush=True)
    if failures:
        raise SystemExit(f"dilocox bench wan: mode(s) failed: {', '.join(failures)} (report and logs in {out_dir})")
    return text


def run_split_allreduce(links, mode, config: RunConfig, options: RunOptions, progress, steps: int) -> ModeResult:
    """AllReduce at a large ratio: `steps` shaped steps for its throughput, the full run over an unshaped
    link for its loss curve (bench/wan_ratio.py)."""
    probe = dataclasses.replace(mode, name=f"{mode.name}-shaped")
    shaped = RUNNERS[mode.runner](links, probe, shaped_probe_config(config, steps), options, lambda n, fields: None)
    with unshaped_links(links.sites) as plain:
        unshaped = RUNNERS[mode.runner](plain, mode, config, options, progress)
    return join_split(mode, shaped, unshaped, steps)
