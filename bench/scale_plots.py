"""PNG plots of `dilocox bench scale`: time and memory against parameters, clusters M and shards N.

Drawn from the rows of one or more scale reports (a sweep is often several runs). matplotlib is the
optional `bench` extra; without it no plots are drawn and the caller says so.
"""

from __future__ import annotations

import pathlib

from dilocox.bench.plots import finish_figure, matplotlib_missing

TIMES = (("push_s", "push"), ("close_s", "close (shard)"), ("pull_replay_s", "pull + replay"))
MEMORY = (("shard_rss_vs_owned", "shard peak RSS / owned fp32"), ("clients_rss_per_param_B", "client B / parameter"))


def _series(rows: list[dict], x: str, fixed: dict) -> list[dict]:
    picked = [r for r in rows if all(r.get(k) == v for k, v in fixed.items())]
    return sorted(picked, key=lambda r: r[x])


def write_scale_plots(out_dir: pathlib.Path, rows: list[dict]) -> list[str]:
    """time_vs_params.png, memory_vs_params.png, time_vs_clusters.png, time_vs_shards.png (those the
    rows have at least two points for); returns the names written."""
    if matplotlib_missing() or not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []

    def plot(fname: str, x: str, xlabel: str, groups: dict[str, list[dict]], keys, ylabel: str, log: bool) -> None:
        groups = {label: pts for label, pts in groups.items() if len(pts) >= 2}
        if not groups:
            return
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        for label, points in groups.items():
            for key, name in keys:
                ys = [p[key] for p in points if p.get(key) is not None]
                xs = [p[x] for p in points if p.get(key) is not None]
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=f"{name}, {label}")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        finish_figure(fig, ax, out_dir / fname, xlabel, ylabel, legend_fontsize=7)
        names.append(fname)

    codecs = sorted({r["codec"] for r in rows})
    # Against parameters: the largest model's M and N, across models.
    by_params = {
        c: [r for r in _series(rows, "params_M", {"codec": c}) if (r["M"], r["N"]) == (4, 4) or r["params_M"] < 1000]
        for c in codecs
    }
    by_params = {
        c: [
            max((r for r in pts if r["params_M"] == p), key=lambda r: (r["M"] == 4, r["N"] == 2))
            for p in sorted({r["params_M"] for r in pts})
        ]
        for c, pts in by_params.items()
    }
    plot(
        "time_vs_params.png",
        "params_M",
        "parameters (M), log",
        {c: pts for c, pts in by_params.items()},
        TIMES,
        "seconds per round, log",
        True,
    )
    plot(
        "memory_vs_params.png",
        "params_M",
        "parameters (M), log",
        {c: pts for c, pts in by_params.items()},
        MEMORY,
        "ratio / bytes, log",
        True,
    )
    smallest = min(r["params_M"] for r in rows)
    plot(
        "time_vs_clusters.png",
        "M",
        "clusters M",
        {f"{c}, N=2": _series(rows, "M", {"codec": c, "N": 2, "params_M": smallest}) for c in codecs},
        TIMES,
        "seconds per round",
        False,
    )
    plot(
        "time_vs_shards.png",
        "N",
        "shards N",
        {f"{c}, M=4": _series(rows, "N", {"codec": c, "M": 4, "params_M": smallest}) for c in codecs},
        TIMES,
        "seconds per round",
        False,
    )
    return names
