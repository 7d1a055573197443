"""`dilocox bench faults`: what one faulty site does to a run, with and without the shards' update check.

The fault drill. Four sites (in-process clusters on threads, sim/inprocess.py) train the
built-in GPT against two shards on localhost gRPC, default compression and one-step delay. One run is
clean; in each of the others the last site is faulty from `--fault-round` on (bench/fault_kinds.py:
×100, sign flip, noise of equal norm, exponent bit flips — any of the 8, or the 7 lower ones — and a
stale replay), its pushes changed after encoding (sim/push_fault.py). Every run goes once per check mode
(server/checks/update_check.py):

* ``warn`` — flagged and merged anyway: the damage a fault does (the same arithmetic as ``off``), and
  when the check sees it;
* ``exclude`` — a flagged or quarantined site's update is left out of the round;
* ``off`` — no check at all (on request: its numbers are warn's).

The clean run's flags, under each mode, are the false alarms. What is reported comes from the shards
themselves: each shard's verdicts per round (recorded as its check returns them), each shard deciding
on its own slices. Goals stated in the issue, checked at the end of the report: no false alarm, every
fault kind flagged within 2 rounds of its start, and with ``exclude`` a final eval loss within 1 % of
the clean run's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time
from dataclasses import dataclass, field

from dilocox.bench.fault_kinds import KINDS, SiteFault
from dilocox.bench.fault_report import goals, plot_curves, ranges
from dilocox.bench.report import write_report
from dilocox.common.config.run import InnerConfig, ModelConfig, RunConfig
from dilocox.server.checks.robust_mean import AGGREGATES, AggregateConfig
from dilocox.server.checks.site_verdict import SiteVerdict
from dilocox.server.checks.update_check import MODES, UpdateCheckConfig
from dilocox.server.shard import Shard
from dilocox.sim.inprocess import run_in_process

CLEAN = "clean"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"fault kinds, of {','.join(KINDS)} (default all; the clean run always runs)",
    )
    parser.add_argument(
        "--modes", default="warn,exclude", help=f"update-check modes, of {','.join(MODES)} (default warn,exclude)"
    )
    parser.add_argument("--rounds", type=int, default=12, help="rounds per run (default 12)")
    parser.add_argument(
        "--fault-round", type=int, default=4, help="the first round the faulty site's pushes are faulty (default 4)"
    )
    parser.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    parser.add_argument("--sites", type=int, default=4, help="sites, the last one faulty (default 4)")
    parser.add_argument("--shards", type=int, default=2, help="aggregation shards (default 2)")
    parser.add_argument("--n-embd", type=int, default=64, help="the built-in GPT's width (default 64, 2 layers)")
    parser.add_argument(
        "--bitflip-fraction",
        type=float,
        default=1e-3,
        help="bitflip, bitflip-low: each sent value's chance of a flipped exponent bit (default 1e-3)",
    )
    parser.add_argument(
        "--norm-ratio",
        type=float,
        default=UpdateCheckConfig.norm_ratio,
        help="the check's norm bound (default: the shards')",
    )
    parser.add_argument(
        "--min-cosine",
        type=float,
        default=UpdateCheckConfig.min_cosine,
        help="the check's cosine bound (default: the shards')",
    )
    parser.add_argument(
        "--data-split",
        default="interleaved",
        choices=("interleaved", "contiguous"),
        help="how the sites share the corpus: interleaved (each a sample of all of it) or contiguous (each "
        "its own stretch: per-site data, the non-IID case the check must not flag) (default interleaved)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run (default 900)")
    parser.add_argument(
        "--aggregate",
        default="mean",
        choices=AGGREGATES,
        help="the shards' round mean, or clipped-mean (server/checks/robust_mean.py; default mean)",
    )
    parser.add_argument(
        "--aggregate-clip-multiple",
        type=float,
        default=AggregateConfig().clip_multiple,
        help="clipped-mean's bound, × the other sites' median norm (default: the shards')",
    )


@dataclass
class FaultRun:
    """One run of the drill: what the shards decided each round, and how the run ended."""

    kind: str  # a fault kind, or "clean"
    mode: str
    faulty: str  # the cluster faulty from the fault round on (honest in the clean run)
    fault_round: int
    verdicts: dict[int, dict[int, tuple[SiteVerdict, ...]]] = field(default_factory=dict)  # shard -> round -> verdicts
    final_eval_loss: float = float("nan")  # the honest sites' mean (each ends on the global model)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (round, site 0's eval loss)
    error: str = ""  # the run stopped (a refused push, a failed close, a non-finite model): where and why
    seconds: float = 0.0
    flipped: int = 0

    def instrument(self, shards: list[Shard]) -> None:
        """Record each shard's verdicts as its check returns them. The round is the shard's open one: the
        check runs while the round is sealed and before its version is published."""
        for shard in shards:
            check = shard.update_check
            if check is None:  # mode off
                continue
            rounds = self.verdicts.setdefault(shard.shard_index, {})

            def recorded(figures, judged=True, shard=shard, review=check.review, rounds=rounds):  # noqa: ANN001
                verdicts = review(figures, judged)
                rounds[shard.open_round] = tuple(verdicts)
                return verdicts

            check.review = recorded

    def rounds_of(self, shard: int, pick) -> list[int]:  # noqa: ANN001
        """Rounds in which `pick(verdict)` holds for the faulty site's verdict on `shard`."""
        return sorted(
            r for r, vs in self.verdicts.get(shard, {}).items() for v in vs if v.cluster == self.faulty and pick(v)
        )

    def honest(self) -> list[SiteVerdict]:
        """Every verdict on a site that was honest when it was given (the faulty one before its fault too)."""
        return [
            v
            for rounds in self.verdicts.values()
            for r, vs in rounds.items()
            for v in vs
            if v.cluster != self.faulty or self.kind == CLEAN or r < self.fault_round
        ]

    def row(self, rounds: int) -> dict:
        shards = sorted(self.verdicts)
        checked = bool(shards)
        flagged = {s: self.rounds_of(s, lambda v: v.reasons) for s in shards}
        first = [next((r for r in flagged[s] if r >= self.fault_round), None) for s in shards]
        faulty_rounds = (
            rounds - self.fault_round + 1
        )  # the fault's training rounds (the end-of-run flush is not judged)
        honest = self.honest()
        cos = [c for v in honest for c in (v.cosine_others, v.cosine_previous) if c is not None]
        ratios = [v.norm_ratio for v in honest if v.norm_ratio is not None]
        reasons = sorted(
            {
                x
                for s in shards
                for vs in self.verdicts[s].values()
                for v in vs
                if v.cluster == self.faulty
                for x in v.reasons
            }
        )
        dash = "-"
        row = {
            "kind": self.kind,
            "mode": self.mode,
            "final_eval_loss": round(self.final_eval_loss, 4),
            "first_flagged": " / ".join(dash if f is None else str(f) for f in first)
            if checked and self.kind != CLEAN
            else dash,
            "flagged_rounds": " / ".join(
                f"{sum(r >= self.fault_round for r in flagged[s])}/{faulty_rounds}" for s in shards
            )
            if checked and self.kind != CLEAN
            else dash,
            "excluded_rounds": " / ".join(ranges(self.rounds_of(s, lambda v: v.excluded)) or dash for s in shards)
            if checked
            else dash,
            "reasons": ",".join(reasons) if reasons and self.kind != CLEAN else dash,
            "false_alarms": sum(bool(v.reasons) for v in honest) if checked else dash,
            "honest_max_norm_ratio": round(max(ratios), 3) if ratios else dash,
            "honest_min_cosine": round(min(cos), 3) if cos else dash,
            "seconds": round(self.seconds, 1),
        }
        row["_first"] = first  # for the goals, not shown
        if self.error:
            row["error"] = self.error
        return row


def _config(args: argparse.Namespace) -> RunConfig:
    inner = InnerConfig(steps=args.inner_steps, warmup_steps=min(20, args.inner_steps))
    return RunConfig(
        run_id="dilocox-bench-faults",
        rounds=args.rounds,
        inner=inner,
        eval_batches=4,
        data_split=args.data_split,
        model=ModelConfig(n_embd=args.n_embd, n_head=4, n_layer=2, block_size=64),
    )


def run_one(args: argparse.Namespace, kind: str, mode: str) -> FaultRun:
    faulty = f"cluster-{args.sites - 1}"
    run = FaultRun(kind, mode, faulty, args.fault_round)
    fault = (
        SiteFault(faulty, kind, args.fault_round, seed=17, bitflip_fraction=args.bitflip_fraction)
        if kind != CLEAN
        else None
    )
    check = UpdateCheckConfig(mode=mode, norm_ratio=args.norm_ratio, min_cosine=args.min_cosine)

    def record(client, report) -> None:  # noqa: ANN001
        if client.cluster == "cluster-0":
            run.curve.append((report.round, report.eval_loss))

    started = time.perf_counter()
    try:
        result = run_in_process(
            _config(args),
            num_clusters=args.sites,
            num_shards=args.shards,
            evaluate_every_round=True,
            timeout_s=args.timeout_s,
            on_round=record,
            update_check=check,
            push_fault=fault,
            before_start=run.instrument,
            aggregate=AggregateConfig(args.aggregate, args.aggregate_clip_multiple),
        )
        honest = [c.final_eval_loss for c in result.clusters if c.client.cluster != faulty or kind == CLEAN]
        run.final_eval_loss = sum(honest) / len(honest)
    except Exception as error:  # noqa: BLE001 - a fault may stop the run (a refused push, a failed close, NaN): a result
        reached = max(
            (r for rounds in run.verdicts.values() for r in rounds), default=max((r for r, _ in run.curve), default=0)
        )
        said = re.sub(r"\b127\.0\.0\.1:\d+: ", "", f"{type(error).__name__}: {error}")
        run.error = f"stopped in round {reached}: {said}"[:300]
    run.seconds = time.perf_counter() - started
    run.flipped = fault.flipped if fault is not None else 0
    return run


def _chosen(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"dilocox bench faults: unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def run(args: argparse.Namespace, out_dir: pathlib.Path) -> str:
    kinds, modes = _chosen(args.kinds, KINDS, "fault kinds"), _chosen(args.modes, MODES, "modes")
    if not 1 <= args.fault_round <= args.rounds:
        raise SystemExit(f"dilocox bench faults: --fault-round must be within 1..{args.rounds}")
    if args.sites < 2:
        raise SystemExit("dilocox bench faults: --sites must be at least 2 (one of them faulty)")
    runs = [run_one(args, kind, mode) for mode in modes for kind in [CLEAN, *kinds]]
    rows = []
    for result in runs:
        row = result.row(args.rounds)
        clean = next(r for r in runs if r.kind == CLEAN and r.mode == result.mode)
        ratio = result.final_eval_loss / clean.final_eval_loss - 1
        row["loss_vs_clean"] = f"{100 * ratio:+.2f}%" if ratio == ratio else "-"
        row["_loss_ratio"] = ratio
        rows.append(row)
    plots = plot_curves(out_dir, runs, args.fault_round)
    (out_dir / "faults_curves.json").write_text(
        json.dumps([{"kind": r.kind, "mode": r.mode, "curve": r.curve} for r in runs])
    )
    flipped = "; ".join(f"{r.kind} ({r.mode}) {r.flipped}" for r in runs if r.flipped)
    mean = (
        f"clipped mean ({args.aggregate_clip_multiple:g}× the others' median norm)"
        if args.aggregate == "clipped-mean"
        else "the plain mean"
    )
    notes = (
        f"{args.sites} sites × {args.shards} shards, {mean}, the built-in GPT (2 layers, width {args.n_embd}), "
        f"{args.rounds} rounds × "
        f"H={args.inner_steps}, default compression and one-step delay, every run on the same data ({args.data_split} "
        "split); the last site "
        f"(cluster-{args.sites - 1}) faulty from round {args.fault_round} on, its end-of-run flush (round "
        f"{args.rounds + 1}: "
        f"residuals, not judged) too. Check against the round's peers: norm ratio > {args.norm_ratio:g}, cosine < "
        f"{args.min_cosine:g}, "
        "replay, acting on at most half a round, quarantine after 2 "
        "flagged rounds in a row (left out, under clip and exclude, until 2 pass in a row). `final_eval_loss`: the "
        "honest sites' mean at the end (each ends on the global model); "
        "`loss_vs_clean`: against the clean run of the same mode. Per shard, separated by ' / ': `first_flagged`, the "
        "first "
        "round from the fault's on in which the shard flagged the faulty site; `flagged_rounds`, in how many of the "
        "fault's rounds; `excluded_rounds`, the rounds it was left out of (exclude mode, quarantine included). "
        "`false_alarms`: flags on honest sites (every site of the clean run, the faulty one before its fault), over "
        "all shards and rounds; `honest_max_norm_ratio` / `honest_min_cosine`: how close the honest sites came to the "
        "bounds (the lowest of the cosines with the others and with the previous update). "
        + (
            f"Values whose exponent bit was flipped, over the run: {flipped} (of ~{args.bitflip_fraction:g} of the "
            "sent values). "
            if flipped
            else ""
        )
        + f"Plot: {', '.join(plots) or 'none (matplotlib missing)'}.\n\n"
        + goals(rows, args.fault_round)
    )
    for row in rows:
        row.pop("_first"), row.pop("_loss_ratio")
    columns = [
        "kind",
        "mode",
        "final_eval_loss",
        "loss_vs_clean",
        "first_flagged",
        "flagged_rounds",
        "excluded_rounds",
        "reasons",
        "false_alarms",
        "honest_max_norm_ratio",
        "honest_min_cosine",
        "seconds",
    ]
    if any("error" in row for row in rows):
        columns.append("error")
    meta = {"args": {k: v for k, v in vars(args).items() if k != "func"}, "faulty": f"cluster-{args.sites - 1}"}
    return write_report(
        out_dir,
        "faults",
        "One faulty site: damage and detection by the shards' update check",
        rows,
        columns,
        notes,
        meta,
    )
