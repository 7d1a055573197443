"""`dilocox bench uneven`: one site slower than the others, under fixed H, time-boxed rounds, and quorum + grace.

Sites and shards are processes on this machine (localhost gRPC, no link shaping: what is measured here
is compute, not the WAN). The slow site is the last one, made slower by a measured per-step sleep
(`dilocox worker --simulate-slowdown F`, worker/train/slowdown.py): it trains at exactly 1/F of its
speed with the same arithmetic, and sleeping leaves the shared cores to the others.

For each site count and slowdown, three modes run with the same model, data and rounds:

* ``fixed``: every site trains H steps; a round closes when every site has delivered (today's default);
* ``timebox``: every site trains ~S seconds per round (`--inner-round-time-s S`), S being what the fast
  sites need for H steps, measured in the even run of the same site count;
* ``quorum``: fixed H; shards close on all sites but one plus a grace window (`--grace-s`, a quarter of
  S), the slow site's late parts carried into its next push.

Each of them also runs with even sites (F = 1): "the new mode costs nothing there". `--quick` runs even
sites for ``fixed`` only (the time box's budget needs it); its other modes have no even row to compare with.

``stall``: even sites, time-boxed rounds and quorum + grace, the last site stopped (SIGSTOP)
for `--stall-boxes` boxes early in round 3, then continued: its late work merged with each
`--stale-weightings` rule (`stall-<rule>`), against the same run without the stall (`calm-<rule>`);
``throttle``: the same site instead runs at a tenth of its speed for that long (stopped 90 ms of every
100), its steps slowing after its round's H was estimated — an incident seen in a real run. Reported per run: the
fast sites' idle share (seconds blocked on the network over their rounds' wall time), the run's
tokens/s, the final eval loss, and the eval loss at the wall time and at the tokens the runs share;
plots of eval loss against wall time and tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import threading
import time
from dataclasses import dataclass, field

from dilocox.bench.plots import finish_figure, matplotlib_missing
from dilocox.bench.report import write_report
from dilocox.bench.wan_procs import ChildProcess, child_env, dilocox_cli, stop_all, wait_all, wait_for_file
from dilocox.common.config.run import InnerConfig, ModelConfig, RunConfig
from dilocox.common.config.run_flags import config_flags

MODES = ("fixed", "timebox", "quorum", "stall", "throttle")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sites", default="2,4", help="site counts to run, comma-separated (default 2,4)")
    parser.add_argument(
        "--slowdowns", default="2,4", help="how much slower the last site is, comma-separated (default 2,4)"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES[:3]),
        help=f"modes to run, of {','.join(MODES)} (default {','.join(MODES[:3])})",
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run (default 10)")
    parser.add_argument("--inner-steps", type=int, default=40, help="H of the fixed modes (default 40)")
    parser.add_argument("--shards", type=int, default=2, help="aggregation shards (default 2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 sites, one slowed 4×, 4 rounds of 8 steps, even sites for fixed only: a smoke run",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run (default 900)")
    parser.add_argument(
        "--stall-boxes", type=float, default=5.0, help="stall mode: how many time boxes the site is stopped (default 5)"
    )
    parser.add_argument(
        "--stale-weightings",
        default="inverse,lenient,full",
        help="stall mode: the stale-work rules to compare (default inverse,lenient,full)",
    )


@dataclass
class UnevenRun:
    sites: int
    slowdown: float
    mode: str
    round_time_s: float = 0.0
    rounds: list[dict] = field(default_factory=list)  # every site's round_done events, with arrival time
    started_at: float = 0.0
    initial_eval_loss: float = float("nan")  # site 0's, at its start
    wall_s: float = 0.0
    final_eval_loss: float = float("nan")

    @property
    def label(self) -> str:
        return f"{self.mode}, {'even' if self.slowdown == 1 else f'1 site {self.slowdown:g}× slower'}"

    def of(self, site: int) -> list[dict]:
        return [r for r in self.rounds if r["cluster"] == f"site-{site}"]

    def fast_idle_share(self) -> float:
        fast = [r for s in range(self.sites - 1) for r in self.of(s)]
        seconds = sum(r["seconds"] for r in fast)
        return sum(r["idle_s"] for r in fast) / seconds if seconds > 0 else float("nan")

    def tokens(self) -> int:
        return sum(r["tokens"] for r in self.rounds)

    def curve(self) -> list[tuple[int, float, float]]:
        """(tokens trained by all sites so far, seconds since start, site 0's eval loss) after each of
        site 0's rounds: the run's progress as a fast site sees it."""
        points, tokens = [(0, 0.0, self.initial_eval_loss)], 0
        for r in sorted(self.rounds, key=lambda r: r["at"]):
            tokens += r["tokens"]
            if r["cluster"] == "site-0":
                points.append((tokens, r["at"] - self.started_at, r["eval_loss"]))
        return points

    def summary(self) -> dict:
        slow = self.of(self.sites - 1)
        return {
            "sites": self.sites,
            "slowdown": self.slowdown,
            "mode": self.mode,
            "fast_idle_share": round(self.fast_idle_share(), 4),
            "tokens_per_s": round(self.tokens() / self.wall_s, 1) if self.wall_s else float("nan"),
            "tokens": self.tokens(),
            "wall_s": round(self.wall_s, 2),
            "fast_h": round(sum(r["inner_steps"] for r in self.of(0)) / max(1, len(self.of(0))), 1),
            "slow_h": round(sum(r["inner_steps"] for r in slow) / max(1, len(slow)), 1),
            "slow_rounds_late": sum(1 for r in slow if r.get("late")),
            "final_eval_loss": round(self.final_eval_loss, 4),
        }


def _config(args: argparse.Namespace, mode: str, round_time_s: float, stale_weighting: str = "inverse") -> RunConfig:
    boxed = mode == "timebox" or mode.startswith(("stall", "throttle", "calm"))
    inner = InnerConfig(
        steps=args.inner_steps,
        batch_size=16,
        warmup_steps=5,
        max_steps=max(200, 8 * args.inner_steps),
        round_time_s=round_time_s if boxed else 0.0,
        min_steps=1,
    )
    return RunConfig(
        run_id="dilocox-bench-uneven",
        rounds=args.rounds,
        inner=inner,
        stale_weighting=stale_weighting,
        model=ModelConfig(block_size=64, n_layer=2, n_head=2, n_embd=64),
    )


def _stall_later(worker: ChildProcess, box_s: float, boxes: float, throttle: bool = False) -> None:
    """Stop `worker` 0.3 of a box from now for `boxes` boxes, then let it go on (in a thread); `throttle`:
    instead run it at a tenth of its speed for that long (stopped 90 ms of every 100: a throttled or
    shared machine, whose steps slow down after its round's H was set)."""

    def stall() -> None:
        time.sleep(0.3 * box_s)
        until = time.monotonic() + boxes * box_s
        while time.monotonic() < until:
            os.kill(worker.proc.pid, signal.SIGSTOP)
            time.sleep(0.09 if throttle else max(0.0, until - time.monotonic()))
            os.kill(worker.proc.pid, signal.SIGCONT)
            time.sleep(0.01 if throttle else 0)

    threading.Thread(target=stall, name="stall", daemon=True).start()


def run_one(
    args: argparse.Namespace,
    out_dir: pathlib.Path,
    sites: int,
    slowdown: float,
    mode: str,
    round_time_s: float,
    stale_weighting: str = "inverse",
) -> UnevenRun:
    """One run; mode "stall-<rule>" stalls the last site in round 3 and weighs its late work by <rule>,
    "calm-<rule>" is the same run without the stall."""
    config = _config(args, mode, round_time_s, stale_weighting)
    run = UnevenRun(sites, slowdown, mode, round_time_s)
    tag = f"{mode}-n{sites}-x{slowdown:g}"
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    # A grace window well inside a round: with the delay, the fast sites wait for a close only past it.
    # Every site in round 1 (--expect-clusters): a site slower to start is not left out as a late joiner.
    quorum = mode == "quorum" or mode.startswith(("stall", "throttle", "calm"))
    grace = (
        ["--min-clusters", str(sites - 1), "--expect-clusters", str(sites), "--grace-s", f"{0.25 * round_time_s:.3g}"]
        if quorum
        else []
    )
    stall = mode.startswith(("stall", "throttle"))
    done: dict[str, dict] = {}

    def on_event(name: str, event: dict, arrived: float) -> None:
        if event.get("event") == "round_done":
            run.rounds.append({**event, "at": arrived})
            if stall and name == f"site-{sites - 1}" and event["round"] == 2:
                _stall_later(workers[-1], round_time_s, args.stall_boxes, throttle=mode.startswith("throttle"))
        elif event.get("event") == "cluster_done":
            done[name] = event
        elif event.get("event") == "cluster_started" and name == "site-0":
            run.initial_eval_loss = event["eval_loss"]

    shards: list[ChildProcess] = []
    workers: list[ChildProcess] = []
    try:
        ports = []
        for i in range(args.shards):
            port_file = logs / f"{tag}-shard{i}.port"
            port_file.unlink(missing_ok=True)
            argv = dilocox_cli(
                "server",
                "--num-shards",
                str(args.shards),
                "--shard-index",
                str(i),
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--run-id",
                config.run_id,
                "--outer-lr",
                str(config.outer.lr),
                "--outer-momentum",
                str(config.outer.momentum),
                "--min-clusters",
                str(sites),
                "--round-deadline-s",
                "0",
                "--log-format",
                "json",
                "--insecure",
                *grace,
            )
            shards.append(ChildProcess(f"shard{i}", argv, logs / f"{tag}-shard{i}.log", env=child_env(1)))
            ports.append(port_file)
        servers = ",".join(f"127.0.0.1:{wait_for_file(pf, shards[i])}" for i, pf in enumerate(ports))
        run.started_at = time.monotonic()
        for site in range(sites):
            slow = ["--simulate-slowdown", f"{slowdown:g}"] if site == sites - 1 and slowdown != 1 else []
            argv = dilocox_cli(
                "worker",
                "--servers",
                servers,
                "--cluster",
                f"site-{site}",
                "--cluster-index",
                str(site),
                "--num-clusters",
                str(sites),
                "--threads",
                "1",
                "--log-format",
                "json",
                "--insecure",
                *slow,
                *config_flags(config),
            )
            workers.append(ChildProcess(f"site-{site}", argv, logs / f"{tag}-site{site}.log", on_event, child_env(1)))
        wait_all(workers, run.started_at + args.timeout_s, tag)
        run.wall_s = time.monotonic() - run.started_at
    finally:
        stop_all(workers)
        stop_all(shards)
    losses = [e["final_eval_loss"] for e in done.values() if e.get("final_eval_loss") is not None]
    run.final_eval_loss = sum(losses) / len(losses) if losses else float("nan")
    return run


def _at(points: list[tuple[int, float, float]], x: float, index: int) -> float:
    """The eval loss at `x` (tokens: index 0; seconds: index 1), linearly between the points around it."""
    for a, b in zip(points, points[1:]):
        if a[index] <= x <= b[index]:
            span = b[index] - a[index]
            return a[2] if span == 0 else a[2] + (b[2] - a[2]) * (x - a[index]) / span
    return float("nan")


def _plots(out_dir: pathlib.Path, runs: list[UnevenRun]) -> list[str]:
    if matplotlib_missing():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for sites, slowdown in sorted({(r.sites, r.slowdown) for r in runs if r.slowdown != 1}):
        group = [r for r in runs if r.sites == sites and r.slowdown in (1, slowdown)]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
        for run in group:
            points = run.curve()[1:]  # from the first round on: the initial loss would flatten the rest
            style = "--" if run.slowdown == 1 else "-"
            axes[0].plot(
                [p[1] for p in points], [p[2] for p in points], style, marker="o", markersize=2, label=run.label
            )
            axes[1].plot(
                [p[0] for p in points], [p[2] for p in points], style, marker="o", markersize=2, label=run.label
            )
        name = f"uneven_n{sites}_x{slowdown:g}.png"
        axes[0].set_title(f"{sites} sites, the last {slowdown:g}× slower", fontsize=10)
        axes[0].set_xlabel("seconds since the sites started")
        axes[0].set_ylabel("eval loss (site 0)")
        axes[0].grid(True, alpha=0.3)
        axes[0].legend(fontsize=7)
        finish_figure(
            fig, axes[1], out_dir / name, "tokens trained (all sites)", "eval loss (site 0)", legend_fontsize=7
        )
        names.append(name)
    return names


def run(args: argparse.Namespace, out_dir: pathlib.Path) -> str:
    site_counts = [2] if args.quick else [int(s) for s in args.sites.split(",")]
    slowdowns = [4.0] if args.quick else [float(s) for s in args.slowdowns.split(",")]
    if args.quick:
        args.rounds, args.inner_steps = 4, 8
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"dilocox bench uneven: unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    runs: list[UnevenRun] = []
    rules = [rule for rule in args.stale_weightings.split(",") if rule]
    disturbed = [kind for kind in ("stall", "throttle") if kind in modes]
    modes = [m for m in modes if m not in disturbed]
    for sites in site_counts:
        # The budget of a time-boxed round: what a site of the even run needed for H steps.
        even_fixed = run_one(args, out_dir, sites, 1.0, "fixed", 0.0)
        per_round = [r["compute_s"] for r in even_fixed.rounds if r["round"] > 1] or [
            r["compute_s"] for r in even_fixed.rounds
        ]
        budget = round(sum(per_round) / len(per_round), 3)
        runs.append(even_fixed)
        # --quick: the smoke run's other even rows (what a mode costs with even sites) are a benchmark
        # figure it does not need; 2 runs of 4 processes fewer.
        for slowdown in slowdowns if args.quick else [1.0, *slowdowns]:
            for mode in modes:
                if (slowdown, mode) != (1.0, "fixed"):
                    runs.append(run_one(args, out_dir, sites, slowdown, mode, budget))
        for rule in rules if disturbed else []:  # even sites, the last one stopped or slowed a while, or not (calm)
            runs.append(run_one(args, out_dir, sites, 1.0, f"calm-{rule}", budget, rule))
            for kind in disturbed:
                runs.append(run_one(args, out_dir, sites, 1.0, f"{kind}-{rule}", budget, rule))
    rows = []
    for result in runs:
        row = result.summary()
        same = [r for r in runs if r.sites == result.sites and r.slowdown == result.slowdown]
        reference = result.mode.replace("stall-", "calm-").replace("throttle-", "calm-")  # against the undisturbed run
        even = next((r for r in runs if r.sites == result.sites and r.slowdown == 1 and r.mode == reference), None)
        common_s = min(r.curve()[-1][1] for r in same if r.curve())
        row["loss_at_common_time"] = round(_at(result.curve(), common_s, 1), 4)
        if even is not None and even.curve() and result.curve():
            common_tokens = min(even.curve()[-1][0], result.curve()[-1][0])
            ref = _at(even.curve(), common_tokens, 0)
            row["loss_vs_even_at_equal_tokens"] = (
                round(_at(result.curve(), common_tokens, 0) / ref - 1, 4) if ref == ref else float("nan")
            )
        rows.append(row)
    (out_dir / "uneven_runs.json").write_text(json.dumps([{**r.summary(), "curve": r.curve()} for r in runs], indent=1))
    plots = _plots(out_dir, runs)
    notes = (
        "fast_idle_share: the fast sites' seconds blocked on the network over their rounds' wall time. tokens_per_s: "
        "all "
        "sites' tokens over the run's wall time. loss_at_common_time: site 0's eval loss at the wall time every run of "
        "the same sites and slowdown reached. loss_vs_even_at_equal_tokens: relative to the same mode with even sites, "
        "at the tokens both trained (stall-<rule>: relative to calm-<rule>, the same run without the stall). "
        "Time-box budget: the even fixed run's mean compute per round. "
        + (
            "--quick: even sites ran fixed only (for the budget), so the other modes have no even row. "
            if args.quick
            else ""
        )
        + "Plots: "
        f"{', '.join(plots) or matplotlib_missing()}"
    )
    columns = [
        "sites",
        "slowdown",
        "mode",
        "fast_idle_share",
        "tokens_per_s",
        "fast_h",
        "slow_h",
        "slow_rounds_late",
        "final_eval_loss",
        "loss_at_common_time",
        "loss_vs_even_at_equal_tokens",
        "wall_s",
    ]
    return write_report(
        out_dir,
        "uneven",
        "Uneven sites: fixed H vs time-boxed vs quorum + grace",
        rows,
        columns,
        notes,
        meta={"rounds": args.rounds, "inner_steps": args.inner_steps, "shards": args.shards},
    )
