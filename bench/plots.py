"""PNG plots of the WAN benchmark: eval loss vs tokens and vs wall-clock time, one line per mode.

matplotlib is an optional extra (`pip install -e ".[bench]"`); without it the report is written with
no plots and says so.
"""

from __future__ import annotations

import pathlib

Curves = dict[str, list[tuple[int, float, float]]]  # label -> [(tokens, seconds, eval loss)]


def matplotlib_missing() -> str | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return 'matplotlib is not installed (pip install -e ".[bench]"): no plots were drawn'
    return None


def finish_figure(fig, ax, path: pathlib.Path, xlabel: str, ylabel: str, legend_fontsize: int = 8) -> None:
    """Label, grid and legend the axes, then write the figure to `path` and close it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_plots(
    out_dir: pathlib.Path, curves: Curves, target: float | None, title: str, unit: str = "nats/byte"
) -> list[str]:
    """Write loss_vs_tokens.png and loss_vs_time.png; returns their file names ([] without matplotlib).
    `unit`: of the loss — nats/byte for the byte tokenizer, nats/token for any other."""
    if matplotlib_missing():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for fname, index, xlabel, log_x in (
        ("loss_vs_tokens.png", 0, "tokens trained (all sites)", False),
        ("loss_vs_time.png", 1, "wall-clock seconds since training started (log scale)", True),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        for label, points in curves.items():
            xs = [p[index] for p in points]
            ys = [p[2] for p in points]
            if log_x:  # the starting point (t = 0) has no place on a log axis
                xs, ys = xs[1:], ys[1:]
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=label)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        if log_x:
            ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        finish_figure(fig, ax, out_dir / fname, xlabel, f"eval loss ({unit})")
        names.append(fname)
    return names
