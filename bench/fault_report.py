"""The fault drill's report helpers (`dilocox bench faults`): round ranges, the issue's goals, the plot."""

from __future__ import annotations

import pathlib

from dilocox.bench.plots import matplotlib_missing

LOSS_GOAL = 0.01  # exclude: final eval loss within 1 % of the clean run's
EVASIONS = (
    "underbound",
    "drift",
    "halfsign",
)  # made to stay under the check's bounds: bounded, not necessarily flagged
EVASION_GOAL = (
    0.02  # the goal for an evasion: under clip or exclude, an evasion's final eval within 2 % of the clean run's
)
CAUGHT_WITHIN = 2  # rounds, counting the fault's first


def ranges(rounds: list[int]) -> str:
    """[4, 5, 6, 9] -> "4-6,9"."""
    parts: list[str] = []
    for r in sorted(rounds):
        if parts and r == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


def goals(rows: list[dict], fault_round: int) -> str:
    """The issue's three goals, each met or not, with the figures that say so. `rows` carry `_first`
    (each shard's first flagged round, None: never) and `_loss_ratio` (final loss / clean − 1)."""
    checked = [r for r in rows if r["mode"] != "off"]
    lines = ["Goals:"]
    clean_alarms = sum(r["false_alarms"] for r in checked if r["kind"] == "clean")
    other_alarms = sum(r["false_alarms"] for r in checked if r["kind"] != "clean")
    lines.append(
        f"* no false alarm: {'met' if clean_alarms == 0 else 'NOT met'} — {clean_alarms} flags on the clean runs' "
        "sites; "
        f"{other_alarms} on the honest sites of the faulty runs"
    )
    late = []
    for kind in sorted({r["kind"] for r in checked if r["kind"] not in ("clean", *EVASIONS)}):
        for row in (r for r in checked if r["kind"] == kind):
            if any(f is None or f > fault_round + CAUGHT_WITHIN - 1 for f in row["_first"]):
                late.append(f"{kind} ({row['mode']}: first flagged {row['first_flagged']})")
    caught = "met" if not late else "NOT met for " + "; ".join(late)
    lines.append(
        f"* every fault kind flagged within {CAUGHT_WITHIN} rounds of its start (round {fault_round} or "
        f"{fault_round + CAUGHT_WITHIN - 1}) by every shard: {caught}"
    )
    excluded = [r for r in rows if r["mode"] == "exclude" and r["kind"] != "clean"]
    if excluded:
        over = [f"{r['kind']} ({r['loss_vs_clean']})" for r in excluded if not r["_loss_ratio"] <= LOSS_GOAL]
        within = "met" if not over else "NOT met for " + ", ".join(over)
        lines.append(f"* with exclude, final eval loss within {100 * LOSS_GOAL:g} % of the clean run's: {within}")
    evasive = [r for r in rows if r["kind"] in EVASIONS and r["mode"] in ("clip", "exclude")]
    if evasive:
        over = [
            f"{r['kind']} ({r['mode']}: {r['loss_vs_clean']})" for r in evasive if not r["_loss_ratio"] <= EVASION_GOAL
        ]
        within = "met" if not over else "NOT met for " + ", ".join(over)
        lines.append(
            f"* evasions ({', '.join(sorted({r['kind'] for r in evasive}))}) under clip or exclude, final eval loss "
            "within "
            f"{100 * EVASION_GOAL:g} % of the clean run's: {within}"
        )
    return "\n".join(lines) + "\n"


def plot_curves(out_dir: pathlib.Path, runs: list, fault_round: int) -> list[str]:  # list[bench.faults.FaultRun]
    """faults_loss.png: site 0's eval loss per round against the clean run's of the same mode, in %, one
    panel per mode, one line per fault kind (symmetric log scale: ×100's +1000 % and exclude's ±0.1 %
    on one axis)."""
    if matplotlib_missing():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in runs))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), dpi=110, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        clean = dict(next((r.curve for r in runs if r.mode == mode and r.kind == "clean"), []))
        shown = [-2.0, 2.0]  # at least ±2 %: the linear part of the axis, with sane ticks
        for run in (r for r in runs if r.mode == mode and r.kind != "clean"):
            points = [(r, 100 * (loss / clean[r] - 1)) for r, loss in run.curve if r in clean and loss == loss]
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                markersize=2,
                label=run.kind + (" (run stopped)" if run.error else ""),
            )
            shown += [p[1] for p in points]
        ax.axvline(fault_round - 0.5, color="grey", linewidth=1, linestyle=":")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(1.3 * min(shown), 1.3 * max(shown))
        ax.set_title(f"update check: {mode} (faulty from round {fault_round}, dotted)", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("site 0's eval loss vs the clean run's, % (symlog)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "faults_loss.png")
    plt.close(fig)
    return ["faults_loss.png"]
