"""`dilocox bench wan`'s report: the table of modes, the measured communication ratio against its bounds,
the scaling note, the link probes and the plots, written by bench/report.py.

Its own module because it only reads what the benchmark (wan.py) measured — the modes' results, the
calibration, the link probes — and turns it into prose and tables; nothing here runs or shapes anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from dilocox.bench.plots import matplotlib_missing, write_plots
from dilocox.bench.report import write_report
from dilocox.bench.wan_calibration import allreduce_link_s
from dilocox.bench.wan_links import LinkSettings
from dilocox.bench.wan_modes import ModeResult
from dilocox.bench.wan_ratio import SPLIT_FROM_RATIO, PaperRegime
from dilocox.common.config.run import as_dict


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
