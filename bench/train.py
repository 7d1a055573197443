"""`dilocox bench train`: inner-step tokens/s and peak memory per model preset and precision, and a
worker's memory when it streams a large prepared token file instead of a small one.

Every row runs in a fresh child process (so peak RSS is that configuration's own): it builds the
trainer exactly as `dilocox worker` does (tokenizer, token data, model, device, precision), runs warm-up
steps, then times `--steps` inner steps. No shards: this is the trainer's cost alone.
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

DEFAULT_ROWS = "gpt:byte,llama-tiny:byte,llama-20m:bpe:8192"
DEFAULT_LAYOUTS = "1x1,1x2,2x1,2x2,1x2x2"
# Wide and short: parameters (what a layout divides) dominate the activations (what it does not).
DEFAULT_LAYOUT_MODEL = "--n-layer 4 --n-embd 1024 --block-size 64"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        default=DEFAULT_ROWS,
        help=f"comma-separated MODEL:TOKENIZER rows (default {DEFAULT_ROWS}; e.g. gpt2-small:bpe:8192 on a GPU)",
    )
    parser.add_argument(
        "--precisions", default="fp32,bf16", help="comma-separated precisions per model (default fp32,bf16)"
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    parser.add_argument("--steps", type=int, default=8, help="timed inner steps per row (default 8, after 2 warm-up)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per child (default: torch's choice)")
    parser.add_argument(
        "--stream-mb",
        type=int,
        default=512,
        help="size of the large prepared token file for the streaming memory rows (default 512; 0 skips them)",
    )
    parser.add_argument("--data", help="text to train on (default: the bundled tinyshakespeare)")
    parser.add_argument(
        "--layouts",
        default=DEFAULT_LAYOUTS,
        help=f"sites of pp×dp[×replicate] ranks against real shards, on the CPU (default {DEFAULT_LAYOUTS}; '' skips "
        "them)",
    )
    parser.add_argument(
        "--layout-variants",
        default="",
        help="host-memory settings each layout runs with, compared in one run: comma-separated of memory "
        "(the start in memory, no checkpoint), checkpointed (+ async checkpoints every round) and lean "
        "(the start on disk, checkpoints written synchronously) (default: the plain run)",
    )
    parser.add_argument(
        "--layout-model",
        default=DEFAULT_LAYOUT_MODEL,
        help=f"model flags of the layout rows (default '{DEFAULT_LAYOUT_MODEL}', batch 2 per replica)",
    )


def _child(spec: dict) -> dict:
    """One measurement, in this (child) process."""
    import torch

    from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig, RunConfig
    from dilocox.worker.data.token_data import load_run_data
    from dilocox.worker.site.plan_measure import peak_rss_bytes
    from dilocox.worker.train.inner_trainer import InnerTrainer

    if spec["threads"] > 0:
        torch.set_num_threads(spec["threads"])
    config = RunConfig(
        tokenizer=spec["tokenizer"],
        model=ModelConfig(model=spec["model"], block_size=spec["block_size"]),
        inner=InnerConfig(batch_size=spec["batch_size"], warmup_steps=2),
        parallel=ParallelConfig(device=spec["device"], precision=spec["precision"]),
    )
    data = load_run_data(config.tokenizer, spec["data"])
    trainer = InnerTrainer(config, data)
    trainer.train_steps(2)
    if trainer.compute.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    loss, tokens, _ = trainer.train_steps(spec["steps"])
    if trainer.compute.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "params_m": round(sum(p.numel() for _, p in trainer.named_parameters()) / 1e6, 2),
        "vocab": data.vocab_size,
        "device": str(trainer.compute.device),
        "tokens_per_s": round(tokens / seconds),
        "loss": round(loss, 3),
        "peak_rss_mb": round(peak_rss_bytes() / 2**20),  # VmHWM: ru_maxrss would carry the parent's peak across exec
        "cuda_peak_mb": round(torch.cuda.max_memory_allocated() / 2**20)
        if trainer.compute.device.type == "cuda"
        else "",
        "corpus_tokens": data.num_tokens,
        "streamed": data.streamed,
    }


def _measure(spec: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "dilocox.bench.train", json.dumps(spec)], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prepared(text_path: pathlib.Path, target_bytes: int, folder: pathlib.Path) -> pathlib.Path:
    """A byte-level prepared token folder of about `target_bytes`, made from `text_path` repeated."""
    from dilocox.worker.data.prepare import prepare_tokens
    from dilocox.worker.data.tokenizer import ByteTokenizer

    text = text_path.read_bytes()
    source = folder / f"text-{target_bytes}.txt"
    with source.open("wb") as f:
        for _ in range(max(1, -(-target_bytes // len(text)))):
            f.write(text)
    out = folder / f"tokens-{target_bytes}"
    prepare_tokens(source, ByteTokenizer(), out)
    source.unlink()
    return out


def run(args: argparse.Namespace, out_dir) -> str:
    from dilocox.bench.report import write_report
    from dilocox.worker.data.sources import default_corpus_path

    base = {
        "device": args.device,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "threads": args.threads,
        "data": args.data,
    }
    rows = []
    for item in [r for r in args.models.split(",") if r]:
        model, _, tokenizer = item.partition(":")
        for precision in [p for p in args.precisions.split(",") if p]:
            result = _measure({**base, "model": model, "tokenizer": tokenizer or "byte", "precision": precision})
            rows.append({"model": model, "tokenizer": tokenizer or "byte", "precision": precision, **result})
            print(json.dumps(rows[-1]), file=sys.stderr)
    stream_rows = []
    if args.stream_mb > 0:
        text = pathlib.Path(args.data) if args.data else default_corpus_path()
        with tempfile.TemporaryDirectory(prefix="dilocox-bench-train-") as tmp:
            for size in (1 << 20, args.stream_mb << 20):
                started = time.perf_counter()
                folder = _prepared(text, size, pathlib.Path(tmp))
                prepare_s = time.perf_counter() - started
                result = _measure(
                    {**base, "model": "gpt", "tokenizer": "byte", "precision": "fp32", "data": str(folder)}
                )
                stream_rows.append({"token_file_mb": round(size / 2**20), "prepare_s": round(prepare_s, 1), **result})
                print(json.dumps(stream_rows[-1]), file=sys.stderr)
    notes = (
        f"{args.steps} timed inner steps after 2 warm-up, batch {args.batch_size} × block {args.block_size}, "
        f"device {args.device}, {os.cpu_count()} CPU cores, torch threads {args.threads or 'default'}. "
        "bf16 is autocast (weights and optimiser state fp32). Peak RSS is the child process's maximum resident set.\n"
    )
    if stream_rows:
        delta = stream_rows[-1].get("peak_rss_mb", 0) - stream_rows[0].get("peak_rss_mb", 0)
        notes += (
            "\n## Streaming a large prepared token file\n\nThe built-in GPT trained from a prepared "
            "token file of each size (byte-level, the corpus repeated):\n\n"
        )
        from dilocox.bench.report import markdown_table

        notes += markdown_table(
            stream_rows, ["token_file_mb", "corpus_tokens", "streamed", "tokens_per_s", "peak_rss_mb", "prepare_s"]
        )
        notes += f"\n\nPeak RSS with the {stream_rows[-1]['token_file_mb']} MB file minus the 1 MB file: {delta} MB.\n"
    layout_rows = _layout_rows(args)
    if layout_rows:
        from dilocox.bench.report import markdown_table

        notes += (
            "\n## Sites of pp × dp ranks\n\nOne site (torchrun, gloo, 1 thread per rank) against 2 real shards, "
            f"`{args.layout_model}`, batch 2 per replica, 3 rounds × 3 steps; steady rounds (after the first). "
            "Boundary: a round's wall time minus its inner steps (eval included).\n\n"
        )
        notes += (
            markdown_table(
                layout_rows,
                [
                    "layout",
                    "ranks",
                    "params_held_m",
                    "tokens_per_s",
                    "boundary_s",
                    "peak_rss_mb_per_rank",
                    "steady_rss_mb_per_rank",
                    "exchange_bytes_per_held_param",
                    "exchange_bytes_per_owned_param",
                    "replay_mismatches",
                ],
            )
            + "\n"
        )
    columns = [
        "model",
        "tokenizer",
        "precision",
        "params_m",
        "vocab",
        "device",
        "tokens_per_s",
        "peak_rss_mb",
        "cuda_peak_mb",
        "loss",
    ]
    if any("error" in r for r in rows):
        columns.append("error")
    return write_report(
        out_dir,
        "train",
        "Trainer throughput and memory per model and precision",
        rows,
        columns,
        notes,
        {"args": vars(args), "stream": stream_rows, "layouts": layout_rows},
    )


def _layout_rows(args: argparse.Namespace) -> list[dict]:
    specs = [tuple(int(v) for v in item.split("x")) for item in args.layouts.split(",") if item.strip()]
    if not specs:
        return []
    from dilocox.bench.site_layouts import VARIANTS, measure_layouts

    layouts = [(s[0], s[1], s[2] if len(s) > 2 else 1) for s in specs]
    variants = tuple(v.strip() for v in getattr(args, "layout_variants", "").split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(
            f"dilocox bench train: --layout-variants {','.join(unknown)}: not one of {', '.join(VARIANTS)}"
        )
    return measure_layouts(
        layouts,
        threads=1,
        model_flags=tuple(args.layout_model.split()),
        rounds=3,
        inner_steps=3,
        batch_size=2,
        microbatches=2,
        variants=variants,
    )


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
