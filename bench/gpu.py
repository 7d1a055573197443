"""`dilocox bench gpu`: the first thing to run on a machine with GPUs — does a site work on this hardware?

Each check is the real thing — `dilocox server` processes on the CPU, `dilocox worker`/`dilocox sim` on
the GPUs — and passes only if it trains to the end with no replay mismatch (every rank's replica of the
shards' weights bit-identical to theirs, on CUDA arithmetic):

* ``sim``    — the default simulation with its clusters on CUDA against CPU shards;
* ``pp1``    — one rank on one GPU, the worker as torchrun starts it (the figures a 1-GPU machine can give);
* ``pp2``    — a site of 2 pipeline stages (NCCL between them);
* ``dp2``    — 2 data-parallel ranks, FSDP2 (bf16 mixed precision where the GPU has it natively);
* ``pp2dp2`` — both, 4 ranks;
* ``accum``  — pp2 with 2 accumulated batches per step;
* ``lean``   — pp1 as a lean rank: the round's start spilled to disk (--spill-dir) and checkpoints written
  synchronously, the exchange's host bytes per parameter against pp1's;
* ``int8`` / ``bf16state`` — pp1 with AdamW's moments in 8 bits / bf16 (`--optimizer-state`): planned against
  measured peak and tokens/s beside pp1's fp32 (torchao's compiled step on CUDA);
* ``resume`` — the largest site that fits, stopped by SIGTERM after round 2 and started with --resume.

A check that needs more GPUs than the machine has is skipped with the reason. Per check: tokens/s,
seconds of each round-boundary phase, peak device memory per rank, the exchange's host bytes per
parameter a rank holds. Without CUDA it prints SKIPPED and exits 0; `--device cpu` runs the same checks
on the CPU (gloo), to try the command anywhere.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from dilocox.bench.site_layouts import (
    VARIANTS,
    LayoutRun,
    _cli,
    layout_flags,
    planned_device_mb,
    run_worker,
    shard_processes,
    summarize,
)

CHECKS = ("sim", "pp1", "pp2", "dp2", "pp2dp2", "accum", "lean", "int8", "bf16state", "resume")
LAYOUTS = {
    "pp1": (1, 1, ()),
    "pp2": (2, 1, ()),
    "dp2": (1, 2, ()),
    "pp2dp2": (2, 2, ()),
    "accum": (2, 1, ("--inner-grad-accum", "2")),
    "lean": (1, 1, VARIANTS["lean"]),
    "int8": (1, 1, ("--optimizer-state", "int8")),
    "bf16state": (1, 1, ("--optimizer-state", "bf16")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cuda (default; skipped where there is none) or cpu (the same checks on gloo)",
    )
    parser.add_argument(
        "--only", default=",".join(CHECKS), help=f"comma-separated checks (default all: {','.join(CHECKS)})"
    )
    parser.add_argument("--quick", action="store_true", help="a small model and 3 rounds (CI and trying it out)")
    parser.add_argument("--n-layer", type=int, default=8, help="layers of the GPT the checks train (default 8)")
    parser.add_argument("--n-embd", type=int, default=512, help="its width (default 512)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per check (default 4; --quick: 3)")


def _model_flags(args: argparse.Namespace) -> tuple[str, ...]:
    if args.quick:
        return ("--n-layer", "2", "--n-embd", "64", "--block-size", "64")
    return ("--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--block-size", "256")


def _gpus(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else 4


def _layout_check(name: str, args: argparse.Namespace, workdir: pathlib.Path) -> dict:
    pp, dp, extra = LAYOUTS[name]
    run = LayoutRun(
        pp, dp, model_flags=_model_flags(args), rounds=3 if args.quick else args.rounds, inner_steps=3, extra=extra
    )
    with shard_processes(2, f"gpu-{name}", workdir) as addresses:
        cmd = _cli(
            "worker",
            "--servers",
            ",".join(addresses),
            "--run-id",
            f"gpu-{name}",
            "--insecure",
            "--log-format",
            "json",
            *layout_flags(run, args.device),
        )
        cmd = [flag.replace("{work}", str(workdir / name)) for flag in cmd]
        rc, run.events = run_worker(cmd, workdir / f"{name}.log", run, timeout_s=900)
    row = summarize(run) if rc == 0 else {}
    if row:
        row["planned_device_mb_per_rank"] = planned_device_mb(run, args.device)
    ok = rc == 0 and row.get("replay_mismatches", 1) == 0
    return {"check": name, "status": "ok" if ok else f"FAILED (exit {rc}; {workdir / f'{name}.log'})", **row}


def _resume_check(args: argparse.Namespace, workdir: pathlib.Path, gpus: int) -> dict:
    pp, dp = (2, 2) if gpus >= 4 else (2, 1) if gpus >= 2 else (1, 1)
    run = LayoutRun(pp, dp, model_flags=_model_flags(args), rounds=5, inner_steps=3)
    ckpt = workdir / "resume-checkpoints"
    with shard_processes(2, "gpu-resume", workdir) as addresses:
        cmd = _cli(
            "worker",
            "--servers",
            ",".join(addresses),
            "--run-id",
            "gpu-resume",
            "--insecure",
            "--log-format",
            "json",
            "--cluster",
            "site",
            "--checkpoint-dir",
            str(ckpt),
            *layout_flags(run, args.device),
        )
        first, _ = run_worker(cmd, workdir / "resume-first.log", None, timeout_s=900, stop_after_round=2)
        rc, events = run_worker([*cmd, "--resume"], workdir / "resume-second.log", None, timeout_s=900)
    restored = sorted({e["round"] for e in events if e.get("event") == "worker_checkpoint_restored"})
    resumed = [e for e in events if e.get("event") == "replica_resumed"]  # by delta, from the replica
    ok = (
        first == 143
        and rc == 0
        and len(restored) == 1
        and restored[0] >= 1
        and all(e["how"] == "delta" for e in resumed)
        and resumed
    )
    return {
        "check": "resume",
        "layout": f"pp{pp}×dp{dp}",
        "status": "ok" if ok else f"FAILED (exits {first}, {rc}; {workdir})",
        "resumed_from_round": restored[0] if restored else None,
        "resume_pulled": " ".join(f"{e['how']} {e['bytes_down']:,} B of {e['full_pull_bytes']:,}" for e in resumed[:1]),
    }


def _sim_check(args: argparse.Namespace, workdir: pathlib.Path) -> dict:
    summary_path = workdir / "sim.json"
    flags = [
        "--rounds",
        "3" if args.quick else str(args.rounds),
        "--inner-steps",
        "20",
        *_model_flags(args),
        "--device",
        args.device,
    ]
    done = subprocess.run(
        _cli("sim", "--log-dir", str(workdir / "sim"), "--summary-json", str(summary_path), *flags),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0 or not summary_path.exists():
        return {"check": "sim", "status": f"FAILED (exit {done.returncode}; {workdir / 'sim'})"}
    s = json.loads(summary_path.read_text())
    ok = s["ok"] and s["replay_mismatches"] == 0 and s["final_eval_loss"] < s["initial_eval_loss"]
    return {
        "check": "sim",
        "layout": "2 clusters × 1 process",
        "status": "ok" if ok else "FAILED",
        "replay_mismatches": s["replay_mismatches"],
        "eval_loss": f"{s['initial_eval_loss']} → {s['final_eval_loss']}",
        "wall_s": s["wall_s"],
    }


def run(args: argparse.Namespace, out_dir) -> str:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        return (
            f"SKIPPED: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
            "`dilocox bench gpu --device cpu` runs the same checks on the CPU\n"
        )
    from dilocox.bench.report import write_report

    gpus = _gpus(args.device)
    names = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        raise SystemExit(f"dilocox bench gpu: unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dilocox-bench-gpu-") as tmp:
        workdir = pathlib.Path(tmp)
        for name in names:
            needed = LAYOUTS[name][0] * LAYOUTS[name][1] if name in LAYOUTS else 1
            if needed > gpus:
                rows.append({"check": name, "status": f"skipped: needs {needed} GPUs, this machine has {gpus}"})
            elif name == "sim":
                rows.append(_sim_check(args, workdir))
            elif name == "resume":
                rows.append(_resume_check(args, workdir, gpus))
            else:
                rows.append(_layout_check(name, args, workdir))
            print(json.dumps(rows[-1]), file=sys.stderr)
        failed = [r["check"] for r in rows if r["status"].startswith("FAILED")]
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo)"
        notes = (
            f"Device: {gpus} × {device}; torch {torch.__version__}. Shards run on the CPU. "
            + ("All checks passed." if not failed else "FAILED: " + ", ".join(failed) + " (logs were in the temp dir)")
            + "\n"
        )
        columns = [
            "check",
            "status",
            "layout",
            "tokens_per_s",
            "device_peak_mb_per_rank",
            "planned_device_mb_per_rank",
            "boundary_phases_s",
            "exchange_bytes_per_held_param",
            "replay_mismatches",
            "eval_loss",
            "resumed_from_round",
            "resume_pulled",
        ]
        text = write_report(
            out_dir, "gpu", "GPU check: a site on this machine's GPUs", rows, columns, notes, {"args": vars(args)}
        )
    if failed:
        print(text)
        raise SystemExit(f"dilocox bench gpu: {len(failed)} check(s) failed: {', '.join(failed)}")
    return text
