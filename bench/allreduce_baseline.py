"""Baseline (a): data-parallel training with an AllReduce of the gradients at every step, across the sites.

One process per site (each in its site's namespace), one gloo process group whose TCP traffic crosses
the shaped links. Same model, same seed, same data shards (rank r samples site r's shard, as cluster r
does), same inner AdamW and learning-rate schedule, and the same global batch per step as the DiLoCo
modes (sites × batch size): after `rounds × H` steps it has trained exactly as many tokens. The
gradients are flattened into one buffer (as DDP's buckets would) and averaged with `all_reduce`; the
averaged gradient is clipped like a single process would, then AdamW steps. Evaluation runs every H steps
on the same fixed eval windows.

Latency: this kernel has no netem, so each collective waits 2·(N−1) one-way latencies (+ jitter) in user
space — the sequential hops of a ring all-reduce. Fallback (no namespaces): each collective also sleeps
until its bytes would have crossed the link at the configured rate.

    python -m dilocox.bench.allreduce_baseline --rank R --world N --master HOST:PORT --config-json '{…}' …
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dilocox.common.config.run import as_dict, from_dict
from dilocox.worker.data.token_data import load_run_data
from dilocox.worker.train.inner_trainer import InnerTrainer


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), file=sys.stderr, flush=True)


def ring_bytes_per_rank(numel: int, world: int, bytes_per_value: int = 4) -> int:
    """What one rank sends (and receives) in a ring all-reduce: 2·(N−1)/N of the buffer."""
    return 2 * (world - 1) * numel * bytes_per_value // world


class AllReduceTrainer:
    def __init__(
        self,
        trainer: InnerTrainer,
        world: int,
        latency_s: float,
        jitter_s: float,
        throttle_bytes_s: float | None,
        seed: int,
    ) -> None:
        self.trainer = trainer
        self.world = world
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.bytes_per_step = ring_bytes_per_rank(self.numel, world)
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.throttle_bytes_s = throttle_bytes_s
        self.rng = random.Random(seed)
        self.compute_s = 0.0
        self.comm_s = 0.0
        self.bytes_sent = 0

    def _wan_wait(self, elapsed: float) -> float:
        """User-space part of the link: ring hops' latency (+ jitter) and, in the fallback, the rate."""
        hops = 2 * (self.world - 1)
        wait = sum(max(0.0, self.latency_s + self.rng.uniform(-self.jitter_s, self.jitter_s)) for _ in range(hops))
        if self.throttle_bytes_s:
            wait += max(0.0, self.bytes_per_step / self.throttle_bytes_s - elapsed)
        return wait

    def step(self) -> tuple[float, int]:
        """One inner step of the site's trainer, its gradients averaged across the sites."""
        began = time.perf_counter()
        comm_before = self.comm_s
        loss, tokens = self.trainer.train_step(reduce_gradients=self._average_gradients)
        self.compute_s += time.perf_counter() - began - (self.comm_s - comm_before)
        self.bytes_sent += self.bytes_per_step
        return loss, tokens

    def _average_gradients(self) -> None:
        """All-reduce the flattened gradients (as DDP's buckets would) plus the user-space link wait;
        only the collective and the wait count as communication."""
        flat = _flatten_dense_tensors([p.grad for p in self.params])
        computed = time.perf_counter()
        dist.all_reduce(flat)
        wait = self._wan_wait(time.perf_counter() - computed)
        if wait > 0:
            time.sleep(wait)
        self.comm_s += time.perf_counter() - computed
        flat /= self.world
        for p, g in zip(self.params, _unflatten_dense_tensors(flat, [p.grad for p in self.params])):
            p.grad.copy_(g)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dilocox.bench.allreduce_baseline")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="host:port of rank 0's TCP rendezvous")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way, added per ring hop")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument(
        "--throttle-mbit", type=float, default=0.0, help="fallback only: sleep bytes/rate per collective"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = from_dict(json.loads(args.config_json))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(minutes=30),
    )
    try:
        trainer = InnerTrainer(config, load_run_data(config.tokenizer, args.data), args.rank, args.world)
        with torch.no_grad():  # as DDP does at construction: every rank starts from rank 0's weights
            for p in trainer.model.parameters():
                dist.broadcast(p, 0)
        ar = AllReduceTrainer(
            trainer,
            args.world,
            args.latency_ms / 1000,
            args.jitter_ms / 1000,
            args.throttle_mbit * 1e6 / 8 if args.throttle_mbit > 0 else None,
            seed=args.rank,
        )
        emit(
            "ar_started",
            rank=args.rank,
            eval_loss=round(trainer.evaluate(), 4),
            params=ar.numel,
            bytes_per_step=ar.bytes_per_step,
            config=as_dict(config),
        )
        dist.barrier()
        began = time.perf_counter()
        steps, every = config.rounds * config.inner.steps, config.inner.steps
        tokens, losses, last_eval = 0, [], float("nan")
        for step in range(1, steps + 1):
            loss, n = ar.step()
            tokens += n * args.world
            losses.append(loss)
            if step % every == 0 or step == steps:
                last_eval = trainer.evaluate()
                emit(
                    "ar_eval",
                    rank=args.rank,
                    step=step,
                    steps=steps,
                    tokens=tokens,
                    train_loss=round(sum(losses) / len(losses), 4),
                    eval_loss=round(last_eval, 4),
                    seconds=round(time.perf_counter() - began, 3),
                    compute_s=round(ar.compute_s, 3),
                    comm_s=round(ar.comm_s, 3),
                )
                losses = []
        wall = time.perf_counter() - began
        emit(
            "ar_done",
            rank=args.rank,
            steps=steps,
            tokens=tokens,
            final_eval_loss=round(last_eval, 4),
            seconds=round(wall, 3),
            compute_s=round(ar.compute_s, 3),
            comm_s=round(ar.comm_s, 3),
            idle_fraction=round(ar.comm_s / wall, 4),
            bytes_sent=ar.bytes_sent,
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
