"""`dilocox bench speed`: a site's tokens/s against a plain torch loop of the same model, batch, optimizer and
data — the site's own overhead as one ratio, with MFU and peak memory, per model, precision and compile
setting.

Why: more than 99 % of a run's FLOPs are the sites' inner steps and the exchange is already hidden beside
them, so what a site keeps of its GPU is this ratio. Both loops run in fresh child processes of their own
(peak memory is each one's), on the same batches (the cluster's sampler, drawn from the run's seed):
* **plain**: `model(x)`, `loss.backward()`, gradient clipping, `opt.step()` — the model as the site builds
  it, torch's AdamW as the site makes it (fused on CUDA), bf16 autocast where the site would use it, the
  same learning-rate schedule; nothing of DiLoCoX around it;
* **site**: the same run as `dilocox worker` against one `dilocox server` shard, each its own process on
  localhost (the real round loop, the compressed exchange, the replay, the per-round eval), `--rounds` rounds
  of `--steps` inner steps, boundaries included.
The first round's worth of steps is warm-up in both (compiling, allocator, the first exchange) and is left
out; so is the site's last round, which also evaluates and flushes. MFU: model FLOPs per token as torchtitan
counts them (6 × the non-embedding parameters + 12 × layers × width × sequence for attention) times
tokens/s, over the device's dense bf16 peak where the table below names it; none on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

DEFAULT_ROWS = "gpt:byte,llama-tiny:byte"
# Dense bf16 peak FLOP/s by device name (vendor data sheets, without sparsity).
BF16_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default=DEFAULT_ROWS,
        help=f"comma-separated MODEL:TOKENIZER rows (default {DEFAULT_ROWS}; on a GPU e.g. "
        "llama-350m:bpe:8192,llama-1b:bpe:8192)",
    )
    parser.add_argument("--precisions", default="auto", help="comma-separated precisions (default auto)")
    parser.add_argument(
        "--compile", default="off,blocks", help="comma-separated --compile settings (default off,blocks)"
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per inner step (default 8)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence (default 128; 2048 on a GPU)")
    parser.add_argument("--steps", type=int, default=50, help="inner steps per round, H (default 50)")
    parser.add_argument(
        "--rounds", type=int, default=4, help="rounds; the first and the last are not timed (default 4)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads per child (default: torch's choice)")
    parser.add_argument("--data", help="text to train on (default: the bundled tinyshakespeare)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each loop per row, alternated; the row keeps each loop's median (default 1; on a shared "
        "machine 3 or more)",
    )


def _config(spec: dict):
    from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig, RunConfig

    return RunConfig(
        rounds=spec["rounds"],
        tokenizer=spec["tokenizer"],
        model=ModelConfig(model=spec["model"], block_size=spec["block_size"]),
        inner=InnerConfig(steps=spec["steps"], batch_size=spec["batch_size"], warmup_steps=2),
        parallel=ParallelConfig(device=spec["device"], precision=spec["precision"], compile=spec["compile"]),
    )


def flops_per_token(model, block_size: int) -> float:
    """Training FLOPs per token as torchtitan counts them: 6 × the parameters outside embedding tables
    (forward and backward of every matrix) + 12 × layers × width × sequence (attention's scores and sums)."""
    import torch

    from dilocox.worker.site.parallelize import transformer_blocks

    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    params = sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in tables)
    width = max((m.embedding_dim for m in tables), default=0)  # the residual stream's width
    return 6.0 * params + 12.0 * len(transformer_blocks(model)) * width * block_size


def _plain(spec: dict) -> dict:
    """The plain loop: no DiLoCoX, the same model, optimizer, schedule and batches."""
    import torch

    from dilocox.worker.data.token_data import load_run_data
    from dilocox.worker.models.build import build_model
    from dilocox.worker.models.contract import lm_loss
    from dilocox.worker.train.block_compile import compile_blocks
    from dilocox.worker.train.device import resolve_compute
    from dilocox.worker.train.inner_trainer import cluster_sampler, inner_lr, make_inner_optimizer

    config = _config(spec)
    data = load_run_data(config.tokenizer, spec["data"])
    compute = resolve_compute(config.parallel)
    model = build_model(config.model, data.vocab_size, config.seed).to(compute.device)
    flops = flops_per_token(model, config.model.block_size)
    if config.parallel.compile == "blocks":
        compile_blocks(model, compute.device)
    optimizer = make_inner_optimizer(config, model.parameters())
    sampler = cluster_sampler(config, data, 0, 1)
    total, warm = config.rounds * config.inner.steps, config.inner.steps
    timed_steps = total - 2 * warm  # as the site's: neither its first nor its last round
    started = 0.0
    for step in range(warm + timed_steps):
        if step == warm:
            _sync(compute.device)
            _reset_peak(compute.device)
            started = time.perf_counter()
        x, y = sampler.next_batch()
        for group in optimizer.param_groups:
            group["lr"] = inner_lr(config, step)
        with compute.autocast():
            loss = lm_loss(model, x.to(compute.device), y.to(compute.device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.inner.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(compute.device)
    seconds = time.perf_counter() - started
    tokens = timed_steps * config.inner.batch_size * config.model.block_size
    return {
        "tokens_per_s": tokens / seconds,
        "flops_per_token": flops,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        **_peak(compute.device),
    }


def _site(spec: dict) -> dict:
    """One DiLoCoX site as a deployment runs it: `dilocox worker` (training on its main thread, the exchange on
    its own threads) against one `dilocox server` shard, each its own process on localhost; its steady rounds,
    boundaries included, from the worker's `round_done` lines. (Trained in a thread beside in-process shards,
    the inner steps ran 25–50 % slower on 2 cores: the shards' and the thread's OpenMP teams share them.)"""
    from dilocox.bench.site_layouts import shard_processes
    from dilocox.common.config.run_flags import config_flags
    from dilocox.sim.child_argv import dilocox_argv

    config = _config(spec)
    outer = ("--outer-lr", str(config.outer.lr), "--outer-momentum", str(config.outer.momentum), "--min-clusters", "1")
    with tempfile.TemporaryDirectory(prefix="dilocox-bench-speed-") as tmp:
        with shard_processes(1, config.run_id, pathlib.Path(tmp), outer) as addresses:
            worker = subprocess.Popen(
                dilocox_argv(
                    "worker", "--servers", addresses[0], "--cluster", "site",
                    "--cluster-index", "0", "--num-clusters", "1", "--insecure", "--log-format", "json",
                    "--threads", str(spec["threads"]), *(["--data", spec["data"]] if spec["data"] else []),
                    *config_flags(config),
                ),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            output, _ = worker.communicate(timeout=3600)
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    reports = [e for e in events if e.get("event") == "round_done"]
    if worker.returncode != 0 or len(reports) < 3:
        return {"error": f"the worker exited with {worker.returncode}: {output.strip().splitlines()[-1:]}"}
    steady = reports[1:-1]
    seconds = sum(r["seconds"] for r in steady)
    memory = next((e for e in events if e.get("event") == "device_memory"), None)
    return {
        "tokens_per_s": sum(r["tokens"] for r in steady) / seconds,
        "inner_tokens_per_s": sum(r["tokens"] for r in steady) / sum(r["compute_s"] for r in steady),
        "boundary_share": sum(r["seconds"] - r["compute_s"] for r in steady) / seconds,
        **(
            {"peak_mb": memory["peak_allocated_mb"], "memory": "CUDA allocated"}
            if memory
            else {"peak_mb": _children_peak_rss_mb(), "memory": "RSS"}
        ),
    }


def _children_peak_rss_mb() -> float:
    """The largest peak resident set of this process's waited-for children: the worker's (the shard, the other
    child, holds one copy of the model and its momentum, less than the worker)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> None:
    import torch

    from dilocox.worker.site.plan_measure import reset_peak_rss

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def _peak(device) -> dict:
    import torch

    from dilocox.worker.site.plan_measure import peak_rss_bytes

    if device.type == "cuda":
        return {"peak_mb": torch.cuda.max_memory_allocated(device) / 2**20, "memory": "CUDA allocated"}
    return {"peak_mb": peak_rss_bytes() / 2**20, "memory": "RSS"}


def _measure(spec: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "dilocox.bench.site_speed", json.dumps(spec)], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_run(results: list[dict]) -> dict:
    """The run whose tokens/s is the median of `results` (the lower middle one of an even count)."""
    ordered = sorted(results, key=lambda r: r["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def peak_flops(device_name: str, precision: str) -> float | None:
    """The device's dense bf16 peak, where the table names it and the run computes in bf16."""
    if precision != "bf16":
        return None
    return next((peak for name, peak in BF16_PEAK.items() if name in device_name), None)


def speed_row(model: str, tokenizer: str, precision: str, compile_mode: str, base: dict) -> dict:
    """One row: the plain loop and the site, each in its own child process, and what follows from both."""
    spec = {**base, "model": model, "tokenizer": tokenizer, "precision": precision, "compile": compile_mode}
    runs: dict[str, list[dict]] = {"plain": [], "site": []}
    for _ in range(base.get("repeat", 1)):  # alternated, so that a slow spell of the machine hits both loops
        for loop in runs:
            runs[loop].append(_measure({**spec, "loop": loop}))
    row = {"model": model, "precision": precision, "compile": compile_mode}
    failed = [r["error"] for loop in runs.values() for r in loop if "error" in r]
    if failed:
        return {**row, "error": failed[0]}
    plain, site = (median_run(runs[loop]) for loop in ("plain", "site"))
    device = _device_name(base["device"])
    row.update(
        params_m=round(plain["params_m"], 2),
        plain_tokens_per_s=round(plain["tokens_per_s"]),
        site_tokens_per_s=round(site["tokens_per_s"]),
        site_over_plain=round(site["tokens_per_s"] / plain["tokens_per_s"], 3),
        inner_over_plain=round(site["inner_tokens_per_s"] / plain["tokens_per_s"], 3),
        boundary_share=round(site["boundary_share"], 3),
        plain_peak_mb=round(plain["peak_mb"]),
        site_peak_mb=round(site["peak_mb"]),
        memory=plain["memory"],
        device=device,
    )
    peak = peak_flops(device, _effective_precision(base["device"], precision))
    for loop, tokens_per_s in (("plain", plain["tokens_per_s"]), ("site", site["tokens_per_s"])):
        row[f"{loop}_mfu"] = round(tokens_per_s * plain["flops_per_token"] / peak, 3) if peak else "—"
    return row


def _device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores)"


def _effective_precision(device: str, precision: str) -> str:
    from dilocox.common.config.parallel import ParallelConfig
    from dilocox.worker.train.device import resolve_compute

    return resolve_compute(ParallelConfig(device=device, precision=precision)).precision


def run(args: argparse.Namespace, out_dir) -> str:
    from dilocox.bench.report import write_report

    base = {
        "device": args.device,
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "data": args.data,
        "repeat": args.repeat,
    }
    if args.rounds < 3:
        raise SystemExit("dilocox bench speed: --rounds must be at least 3 (the first and the last are not timed)")
    rows = []
    for item in [r for r in args.models.split(",") if r]:
        model, _, tokenizer = item.partition(":")
        for precision in [p for p in args.precisions.split(",") if p]:
            for compile_mode in [c for c in args.compile.split(",") if c]:
                rows.append(speed_row(model, tokenizer or "byte", precision, compile_mode, base))
                print(json.dumps(rows[-1]), file=sys.stderr)
    notes = (
        f"Batch {args.batch_size} × {args.block_size} tokens, H = {args.steps}, {args.rounds} rounds (the first "
        f"and the last not timed; the plain loop the same steps), device {args.device}, torch threads "
        f"{args.threads or 'default'}, the median of {args.repeat} alternated run(s) of each loop. "
        "site_over_plain: the site's tokens/s over the plain loop's (1.0: no "
        "overhead); inner_over_plain: the same for the site's inner steps alone; boundary_share: the part of the "
        "site's steady rounds outside its inner steps (its per-round eval, compression, what of the exchange is not "
        "hidden). MFU over the device's dense bf16 peak (— where none is named or the run is not bf16). Peak memory: "
        "the plain loop's process from its first timed step on; the site's worker process over its run (on a GPU, "
        "the CUDA peak the worker logs).\n"
    )
    columns = [
        "model",
        "precision",
        "compile",
        "params_m",
        "plain_tokens_per_s",
        "site_tokens_per_s",
        "site_over_plain",
        "inner_over_plain",
        "boundary_share",
        "plain_mfu",
        "site_mfu",
        "plain_peak_mb",
        "site_peak_mb",
        "memory",
        "device",
        "error",
    ]
    return write_report(out_dir, "speed", "A site against a plain torch loop", rows, columns, notes)


def _child_main(spec: dict) -> None:
    import torch

    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    result = _plain(spec) if spec["loop"] == "plain" else _site(spec)
    print(json.dumps(result))


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
