"""`dilocox bench wan`: DiLoCoX vs DiLoCo vs data-parallel AllReduce over shaped WAN links, on one machine.

Each site runs in its own network namespace, joined to a hub (the aggregation shards) by a veth pair that
`tc tbf` limits to the link rate in both directions (bench/netns.py); latency and jitter are added in user
space (no netem here). Without namespaces (not root, restricted sandbox) it says so and falls back to a
token-bucket throttle in a relay on the gRPC byte streams (bench/wan_links.py), labelled in the report.

Every mode trains the same model on the same data shards for the same tokens (rounds × H × batch ×
sites). Scaling: the small CPU model must see the communication-to-compute ratio of a large model on
1 Gbit/s, so the default link rate is derived from the measured step time (see `scaling_note`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import time

import torch

from dilocox.bench import netns
from dilocox.bench.allreduce_baseline import ring_bytes_per_rank
from dilocox.bench.plots import matplotlib_missing, write_plots
from dilocox.bench.report import write_report
from dilocox.bench.wan_links import LinkSettings, LoopbackLinks, NamespaceLinks, measure_links
from dilocox.bench.wan_modes import ABLATIONS, ALL_MODES, MODES, ModeResult
from dilocox.bench.wan_ratio import (
    DEFAULT_SHAPED_STEPS,
    SPLIT_FROM_RATIO,
    PaperRegime,
    join_split,
    paper_regime,
    shaped_probe_config,
    unshaped_links,
)
from dilocox.bench.wan_runs import RUNNERS, RunOptions
from dilocox.common.config.run import InnerConfig, RunConfig, as_dict
from dilocox.common.config.run_flags import add_config_arguments, config_from_args
from dilocox.worker.data.token_data import TokenData, load_run_data
from dilocox.worker.train.inner_trainer import InnerTrainer

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


def calibrate(config: RunConfig, data: bytes | TokenData, sites: int, threads: int, steps: int = 10) -> dict:
    """Time the inner step of one site on this machine (after 3 warm-up steps)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer = InnerTrainer(config, data, 0, sites)
        trainer.train_steps(3)
        _, tokens, seconds = trainer.train_steps(steps)
    finally:
        torch.set_num_threads(previous)
    params = sum(p.numel() for _, p in trainer.named_parameters())
    return {
        "step_s": round(seconds / steps, 5),
        "tokens_per_step_per_site": tokens // steps,
        "params": params,
        "allreduce_bytes_per_step_per_site": ring_bytes_per_rank(params, sites),
    }


def allreduce_link_s(calibration: dict, rate_mbit: float) -> float:
    """One step's fp32 AllReduce on the link by bytes / rate (seconds)."""
    return calibration["allreduce_bytes_per_step_per_site"] * 8 / (rate_mbit * 1e6)


def auto_rate_mbit(calibration: dict, ratio: float) -> float:
    """The rate at which one step's AllReduce takes `ratio` × one step's compute."""
    seconds = ratio * calibration["step_s"]
    return round(min(10_000.0, max(0.1, calibration["allreduce_bytes_per_step_per_site"] * 8 / seconds / 1e6)), 3)


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


def measured_ratio(base: ModeResult) -> tuple[float, float, float]:
    """(r, collective s, compute s) per AllReduce step on the shaped link. Split: the collectives of the
    shaped steps against the compute of the full (unshaped) run, which does not depend on the link and is
    averaged over every step rather than a few."""
    steps = max(1, base.extra.get("steps", 1))
    comm, compute = base.comm_s / steps, base.compute_s / steps
    return comm / max(1e-9, compute), comm, compute


def ratio_lines(
    results: dict[str, ModeResult], calibration: dict, settings: LinkSettings, regime: PaperRegime | None
) -> list[str]:
    """The measured communication ratio and each mode's speed-up over AllReduce next to its bound."""
    base = results.get("allreduce")
    lines = [f"stated regime: {regime.describe()}"] if regime else []
    link_s = allreduce_link_s(calibration, settings.rate_mbit)
    expected = link_s / calibration["step_s"]
    if base is None:
        return lines + [f"r = {expected:.0f} from bytes / rate / calibrated step (no AllReduce run to measure it)"]
    r, comm, compute = measured_ratio(base)
    lines.append(
        f"measured r = {r:.0f}: AllReduce's collective {comm:.3f} s vs compute {compute * 1000:.0f} ms per step "
        f"(bytes / rate / calibrated step: {expected:.0f}; bytes / rate alone {link_s:.3f} s per collective, and "
        "compute slows down when other work shares the cores)"
    )
    for name, result in results.items():
        if name != "allreduce":
            lines.append(
                f"{name}: {result.tokens_per_s / base.tokens_per_s:.1f}× AllReduce's tokens/s; "
                f"bound (T + t_AR) / T = {1 + r:.1f}×"
            )
    return lines


def scaling_note(calibration: dict, settings: LinkSettings, ratio: float, auto: bool) -> str:
    step = calibration["step_s"]
    comm = allreduce_link_s(calibration, settings.rate_mbit)
    return (
        "**Scaling.** What decides AllReduce vs DiLoCo is r = (time of one step's AllReduce on the link) / (time of "
        "one "
        "step's compute). For a compute-bound model of N parameters r does not depend on N: the AllReduce moves "
        "2·(S−1)/S·b·N bytes per site (b bytes per gradient value) and a step costs 6·N·T FLOPs (T tokens per site), "
        "so "
        "r = 2·(S−1)/S · 8·b·F / (6·T·R) for a site of F FLOP/s on a link of R bit/s. Reference: 2 sites of 8 A100s "
        "(F ≈ 1 PFLOP/s at 40% MFU), 128k tokens per site per step, bf16 gradients (b = 2), R = 1 Gbit/s → r ≈ 20, "
        "whatever the model's size; more GPUs per site or smaller batches give larger r (the paper's 357× needs "
        f"r > 350). Here: the default model's step takes {step * 1000:.1f} ms on one core "
        f"({calibration['tokens_per_step_per_site']} "
        f"tokens per site, measured before the run) and its fp32 ring AllReduce moves "
        f"{calibration['allreduce_bytes_per_step_per_site']:,} bytes per site, so "
        + (
            f"r = {ratio:g} gives {settings.rate_mbit:g} Mbit/s per direction."
            if auto
            else f"the given {settings.rate_mbit:g} Mbit/s means r ≈ {comm / step:.1f}."
        )
        + f" Latency is scaled the same way: 25 ms one way at a ~4 s step is ≈0.6% of a step; {settings.latency_ms:g} "
        "ms "
        f"± {settings.jitter_ms:g} ms at a {step * 1000:.0f} ms step is a little more.\n"
    )


def write_wan_report(
    out_dir,
    args,
    config,
    calibration,
    settings,
    describe,
    probes,
    results,
    failures,
    elapsed,
    regime: PaperRegime | None,
    ratios: list[str],
) -> str:
    base = results.get("allreduce")
    losses = [r.final_eval_loss for r in results.values() if r.finite()]
    target = args.target_loss if args.target_loss is not None else (max(losses) if losses else None)
    rows = []
    for name, r in results.items():
        to_target = r.time_to(target) if target is not None else None
        rows.append(
            {
                "mode": name,
                "tokens": r.tokens,
                "tokens_per_s": round(r.tokens_per_s),
                "vs_allreduce_speed": round(r.tokens_per_s / base.tokens_per_s, 2) if base else "",
                "time_to_target_s": round(to_target, 1) if to_target is not None else "not reached",
                "final_eval_loss": r.final_eval_loss,
                "loss_vs_allreduce": f"{(r.final_eval_loss / base.final_eval_loss - 1) * 100:+.1f}%" if base else "",
                "sent_MB_per_site": round(r.bytes_sent_per_site / 1e6, 3)
                if math.isfinite(r.bytes_sent_per_site)
                else "",
                "idle_fraction": r.idle_fraction,
                "train_s": r.train_s,
            }
        )
    for name, error in failures.items():
        rows.append({"mode": name, "tokens": f"FAILED: {error.splitlines()[0][:120]}"})
    plots_missing = matplotlib_missing()
    curves = {f"{r.mode}": [(p.tokens, p.seconds, p.eval_loss) for p in r.curve] for r in results.values()}
    plots = (
        write_plots(
            out_dir,
            curves,
            target,
            f"{args.sites} sites, {settings.rate_mbit:g} Mbit/s, {links_word(describe)}",
            "nats/byte" if config.tokenizer == "byte" else "nats/token",
        )
        if curves
        else []
    )
    tokens = config.rounds * config.inner.steps * config.inner.batch_size * config.model.block_size * args.sites
    probe_lines = "\n".join(
        f"| {path} | {p['configured_mbit_per_s']:g} | {p['mbit_per_s']:.2f} | {p['ratio'] * 100:.1f}% | "
        f"{p['goodput_mbit_per_s']:.2f} | {p['measured_by']} |"
        for path, p in probes.items()
    )
    fallback = describe["kind"] != "netns"
    target_text = (
        "none"
        if target is None
        else f"{target:.4f}" + (", the worst final loss of the modes" if args.target_loss is None else "")
    )
    notes = (
        (
            f"**⚠ {describe['label']}.** Why: {describe.get('why_no_namespaces')}.\n\n"
            if fallback
            else f"**Links:** {describe['label']}.\n\n"
        )
        + f"Setup: {args.sites} sites, {args.shards} shards, model of {calibration['params']:,} parameters, "
        f"{config.rounds} rounds × "
        f"H={config.inner.steps} × batch {config.inner.batch_size} × {config.model.block_size} tokens per site = "
        f"{tokens:,} tokens "
        f"per mode (AllReduce: {config.rounds * config.inner.steps} steps at global batch "
        f"{args.sites}×{config.inner.batch_size}); "
        f"1 torch thread per site process, {os.cpu_count()} CPU cores. Link: {settings.rate_mbit:g} Mbit/s per "
        "direction, "
        f"{settings.latency_ms:g} ± {settings.jitter_ms:g} ms one-way latency. Run took {elapsed / 60:.1f} min.\n\n"
        "Measured throughput of a bulk TCP transfer through the shaped link, over its steady part (after a warm-up). "
        "`measured`: frames through the shaped device per second from the kernel's interface counters (what tbf "
        "meters; "
        "the relay's forwarded bytes in the fallback); `goodput`: payload bytes the receiver read (Ethernet/IP/TCP "
        "headers "
        "make it ~4% lower; it is read in user space, so a busy CPU makes it noisier):\n\n"
        "| path | configured Mbit/s | measured Mbit/s | measured / configured | goodput Mbit/s | measured by |\n"
        "| --- | --- | --- | --- | --- | --- |\n"
        f"{probe_lines}\n\n"
        + scaling_note(calibration, settings, args.comm_ratio, args.rate_mbit <= 0)
        + "".join(f"* {line}\n" for line in ratios)
        + "\n"
        + (
            f"**AllReduce split** (r > {SPLIT_FROM_RATIO:g} or `--allreduce-steps`): its throughput comes from "
            f"{base.extra['split']['shaped_steps']} steps on the shaped link, its loss curve from the same "
            "configuration over an "
            "unshaped link (identical numerics); each point keeps that run's compute and evaluation time and takes "
            "the shaped "
            "collective time per step (bench/wan_ratio.py).\n\n"
            if base and base.extra.get("split")
            else ""
        )
        + "\n**Latency** is added in user space because this kernel has no `netem`: the gRPC streams go through a "
        "relay "
        "(bench/relay.py) in the hub that delivers each chunk latency ± jitter later, in order; the AllReduce waits "
        "2·(S−1) one-way latencies per collective (a ring's sequential hops). Bandwidth is the kernel's tbf"
        + (
            " — except in this fallback run, where the relay's token bucket meters the gRPC streams and the AllReduce "
            "sleeps bytes/rate after each collective."
            if fallback
            else "."
        )
        + "\n\n**Columns.** `tokens_per_s`: tokens of all sites / training wall time (first site ready → last site "
        "done, "
        "evaluations included). `time_to_target_s`: first evaluation at or below the target eval loss "
        f"({target_text}). "
        "`final_eval_loss`: the final "
        "(global) model on the fixed eval windows after the same tokens. `sent_MB_per_site`: bytes the site put on "
        "its link "
        f"({', '.join(sorted({r.bytes_source for r in results.values()}))}), setup (join, initial weights, rendezvous) "
        "included. `idle_fraction`: share of a site's training time blocked on the network (AllReduce: inside the "
        "collectives; DiLoCo: waiting for the round's exchange).\n\n"
        + ("".join(f"![{p}]({p})\n" for p in plots) if plots else f"No plots: {plots_missing or 'no mode finished'}.\n")
    )
    meta = {
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "config": as_dict(config),
        "links": describe,
        "settings": dataclasses.asdict(settings),
        "probes": probes,
        "calibration": calibration,
        "target_loss": target,
        "modes": {name: {**dataclasses.asdict(r), "tokens_per_s": r.tokens_per_s} for name, r in results.items()},
        "failures": failures,
        "plots": plots,
        "plots_missing": plots_missing,
        "elapsed_s": round(elapsed, 1),
        "regime": dataclasses.asdict(regime) | {"ratio": regime.ratio} if regime else None,
        "ratio_lines": ratios,
    }
    how = "IN-PROCESS FALLBACK throttle" if fallback else "shaped namespaces"
    title = f"WAN benchmark: DiLoCoX vs DiLoCo vs AllReduce ({how})"
    columns = [
        "mode",
        "tokens",
        "tokens_per_s",
        "vs_allreduce_speed",
        "time_to_target_s",
        "final_eval_loss",
        "loss_vs_allreduce",
        "sent_MB_per_site",
        "idle_fraction",
        "train_s",
    ]
    return write_report(out_dir, "wan", title, rows, columns, notes, json.loads(json.dumps(meta, default=str)))


def links_word(describe: dict) -> str:
    return "tc tbf in namespaces" if describe["kind"] == "netns" else "in-process fallback throttle"
