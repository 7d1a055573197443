"""`dilocox bench compression`: bytes on the wire against final eval loss, per compression setting.

The issue-5 ablation as a command. Every configuration trains the default sim (2 clusters, 2 shards on
localhost gRPC, the default model and data) for the same rounds and steps, so all of them see the same
tokens; the reference is synchronous DiLoCo with dense fp32 pseudo-gradients. For each it reports:

* bytes per cluster per round, uplink and downlink, counted at the gRPC message layer (framing
  included), and the ratio to the dense fp32 model size;
* the final eval loss of the global model and its gap to the reference;
* the *withheld signal*: ‖Σ_t Δ_t − Σ_t D(C(Δ_t))‖ / ‖Σ_t Δ_t‖ on cluster 0 — what compression has
  kept from the shards over the training rounds. Error feedback bounds it by the last residual; without
  it the dropped parts pile up. This is the signal-level effect of error feedback, reported beside its
  effect on the loss, which is the one that counts;
* the bytes of the end-of-run flush (error feedback's last residuals, sent once, densely quantised),
  a one-off per run like the initial weights, reported apart from the per-round figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from dilocox.bench.report import write_report
from dilocox.common.config.run import InnerConfig, RunConfig
from dilocox.common.wire.compression import CompressionConfig
from dilocox.sim.inprocess import run_in_process

_NO_EF = dict(error_feedback=False)
_CLASSIC_EF = dict(error_feedback=True, local_residual=False)
# Presets the wire benchmark reports too (one definition, so both reports measure the same settings).
PREVIOUS_DEFAULT = CompressionConfig(rank_max=24, target_energy=0.95, error_feedback=False)  # before error feedback
LEAN_PRESET = CompressionConfig(rank_max=6)  # fewer bytes than the default (≈ 128×) for a higher loss


@dataclasses.dataclass(frozen=True)
class Setting:
    label: str
    delay: int
    compress: CompressionConfig


SETTINGS = {
    "fp32-sync": Setting("dense fp32, synchronous (DiLoCo, the reference)", 0, CompressionConfig(codec="fp32")),
    "fp32-delay": Setting("dense fp32, one-step delay", 1, CompressionConfig(codec="fp32")),
    "default-sync": Setting(
        "default compression (rank ≤ 8, error feedback kept locally), synchronous", 0, CompressionConfig()
    ),
    "default": Setting(
        "default DiLoCoX (one-step delay + default compression, ending with the int4 flush of the residuals)",
        1,
        CompressionConfig(),
    ),
    "no-flush": Setting(
        "default DiLoCoX without the end-of-run flush (ends on the last round's global model)",
        1,
        CompressionConfig(flush_codec="none"),
    ),
    "no-ef-sync": Setting("default ranks without error feedback, synchronous", 0, CompressionConfig(**_NO_EF)),
    "no-ef": Setting("default ranks without error feedback, one-step delay", 1, CompressionConfig(**_NO_EF)),
    "classic-ef-sync": Setting(
        "default ranks + classic error feedback (residual only re-sent, not kept in "
        "the cluster's weights), synchronous",
        0,
        CompressionConfig(**_CLASSIC_EF),
    ),
    "r6": Setting("rank ≤ 6 (the lean preset), one-step delay", 1, LEAN_PRESET),
    "r6-sync": Setting("rank ≤ 6 (the lean preset), synchronous", 0, LEAN_PRESET),
    "previous": Setting(
        "previous default (rank ≤ 24, 95% energy, no error feedback), one-step delay", 1, PREVIOUS_DEFAULT
    ),
}
REFERENCE = "fp32-sync"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds", type=int, default=RunConfig().rounds, help="rounds per setting (default: the sim's)"
    )
    parser.add_argument("--inner-steps", type=int, default=InnerConfig().steps, help="H (default: the sim's)")
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"comma-separated subset of {', '.join(SETTINGS)} (the reference {REFERENCE} always runs)",
    )


def chosen_settings(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
    return [REFERENCE] + [n for n in names if n != REFERENCE]


def run_setting(name: str, rounds: int, inner_steps: int) -> dict:
    setting = SETTINGS[name]
    config = RunConfig(
        rounds=rounds, delay=setting.delay, inner=InnerConfig(steps=inner_steps), compress=setting.compress
    )
    started = time.perf_counter()
    withheld: list[float] = []  # ‖Σ Δ − Σ decoded‖ on cluster 0 after each of its rounds
    relative_withheld = [0.0]  # the same over ‖Σ Δ‖ after the last round (before the end-of-run flush)

    def record(client, _report) -> None:
        if client.cluster == "cluster-0":
            compressor = client.compressor
            withheld.append(compressor.deficit_norm() if compressor else 0.0)
            relative_withheld[0] = compressor.relative_deficit() if compressor else 0.0

    result = run_in_process(config, num_clusters=2, num_shards=2, track_deficit=True, on_round=record)
    dense = 4 * result.num_params
    up, down = result.bytes_per_round()
    flushes = [c.flush for c in result.clusters if c.flush]
    flush_up = sum(f["bytes_up"] for f in flushes) / len(result.clusters)
    flush_down = sum(f["bytes_down"] for f in flushes) / len(result.clusters)
    return {
        "setting": name,
        "description": setting.label,
        "up_bytes_per_round": round(up),
        "down_bytes_per_round": round(down),
        "up_vs_dense_fp32": round(dense / up, 1),
        "down_vs_dense_fp32": round(dense / down, 1),
        "final_eval_loss": round(result.mean_final_eval_loss(), 4),
        "flush_bytes_up": round(flush_up),
        "flush_bytes_down": round(flush_down),
        "flush_in_rounds": round(flush_up / up, 1),
        "withheld_signal": round(relative_withheld[0], 4),
        "withheld_norm_by_quarter": " → ".join(
            f"{withheld[max(0, len(withheld) * q // 4 - 1)]:.3f}" for q in (1, 2, 3, 4)
        )
        if withheld
        else "",
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(args: argparse.Namespace, out_dir) -> str:
    rows = [run_setting(name, args.rounds, args.inner_steps) for name in chosen_settings(args.settings)]
    reference = rows[0]["final_eval_loss"]
    for row in rows:
        row["loss_vs_reference"] = f"{100 * (row['final_eval_loss'] / reference - 1):+.1f}%"
    columns = [
        "setting",
        "up_bytes_per_round",
        "down_bytes_per_round",
        "up_vs_dense_fp32",
        "down_vs_dense_fp32",
        "final_eval_loss",
        "loss_vs_reference",
        "flush_bytes_up",
        "flush_in_rounds",
        "withheld_signal",
        "withheld_norm_by_quarter",
        "seconds",
    ]
    notes = (
        f"2 clusters × 2 shards, {args.rounds} rounds × H={args.inner_steps}, the default model and corpus; every "
        "setting trains on the same tokens. Bytes: per cluster per round (rounds ≥ 2), at the gRPC message "
        "layer, framing included; dense fp32 = 4 bytes × parameters. `loss_vs_reference`: final eval loss "
        f"against {SETTINGS[REFERENCE].label}. `flush_bytes_up`: the end-of-run flush of the error-feedback "
        "residuals, per cluster, once per run (not in the per-round figures; about as much comes back down); "
        "`flush_in_rounds`: the same in rounds' worth of uplink. `withheld_signal`: ‖ΣΔ − Σ decoded‖ / ‖ΣΔ‖ "
        "over the training rounds (before the flush) on cluster 0's uplink; `withheld_norm_by_quarter`: "
        "‖ΣΔ − Σ decoded‖ after a quarter, half, three quarters and all of the rounds (with one-step delay the "
        "compression runs in the background, so "
        "a value may lag a round).\n\n"
        + "\n".join(f"* `{row['setting']}`: {row['description']}" for row in rows)
        + "\n"
    )
    meta = {
        "args": vars(args),
        "settings": {n: dataclasses.asdict(SETTINGS[n]) for n in chosen_settings(args.settings)},
    }
    return write_report(
        out_dir, "compression", "Compression: bytes on the wire vs final eval loss", rows, columns, notes, meta
    )
