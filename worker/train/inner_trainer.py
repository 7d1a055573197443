"""The local half of DiLoCo: a model, its inner AdamW, and this cluster's stream of batches.

Knows nothing about shards or rounds; the round loop (`worker.cluster`) drives it `H` steps at a
time and reads/writes its parameters at round boundaries. The inner optimiser's state persists across
rounds (DiLoCo never resets it), and its learning rate follows one warm-up + cosine schedule over the
whole run's inner steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from dilocox.common.config.run import RunConfig
from dilocox.worker.data.corpus import BatchSampler, check_split, data_part, evaluate_run
from dilocox.worker.data.token_data import EVAL_FRACTION, TokenData
from dilocox.worker.models.build import build_model
from dilocox.worker.models.contract import lm_loss
from dilocox.worker.site.parallelize import checkpoint_blocks
from dilocox.worker.train.block_compile import compile_blocks
from dilocox.worker.train.device import Compute, resolve_compute


def inner_lr(config: RunConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to 10% over the run's inner steps (rounds × H)."""
    inner = config.inner
    total_steps = max(1, config.rounds * inner.steps)
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    progress = min(1.0, (step - inner.warmup_steps) / max(1, total_steps - inner.warmup_steps))
    return inner.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_inner_optimizer(config: RunConfig, params) -> torch.optim.Optimizer:
    """The inner AdamW over `params`, its moments as `--optimizer-state` says. fp32: torch's AdamW — fused
    on GPUs (one kernel per step and no transient copy of the weights, torchtitan's default there), its
    default foreach path on the CPU (as every earlier run, bit for bit); bf16/int8: `LightAdamW`."""
    inner, state = config.inner, config.parallel.optimizer_state
    params = list(params)
    hyper = dict(lr=inner.lr, betas=(inner.beta1, inner.beta2), weight_decay=inner.weight_decay)
    if state != "fp32":
        from dilocox.worker.train.light_adamw import LightAdamW

        return LightAdamW(params, **hyper, state=state)
    on_gpu = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(params, **hyper, fused=True if on_gpu else None)


def cluster_sampler(config: RunConfig, data: TokenData, cluster_index: int, num_clusters: int) -> BatchSampler:
    """This cluster's stream of training batches: its part of the run's data (`--data-split`), drawn from the
    run's seed — the same batches wherever it is built (a benchmark's plain loop draws the site's)."""
    part = data_part(config.data_split, config.seed, cluster_index, num_clusters)
    check_split(len(data.train), len(data.eval), config.model.block_size, part.count)
    return BatchSampler(
        data.train,
        config.model.block_size,
        config.inner.batch_size,
        part.seed,
        part.index,
        part.count,
        split=part.split,
    )


class InnerTrainer:
    """One process: the whole model on one device (`--device`), bf16 autocast where asked
    (`--precision`), `grad_accum` micro-batches per inner step. Takes a corpus as bytes (byte-level)
    or the run's `TokenData` (any tokenizer, in memory or streamed from a prepared file). Its checkpoint
    (worker/checkpoint.py) reads `trained_module`, `optimizer`, `sampler`, `step` and `tokens_seen`."""

    def __init__(
        self,
        config: RunConfig,
        corpus: bytes | TokenData,
        cluster_index: int = 0,
        num_clusters: int = 1,
        compute: Compute | None = None,
    ) -> None:
        self.config = config
        self.data = corpus if isinstance(corpus, TokenData) else TokenData.from_bytes(corpus, EVAL_FRACTION)
        self.sampler = cluster_sampler(config, self.data, cluster_index, num_clusters)
        self.eval_data = self.data.eval
        self.compute = compute or resolve_compute(config.parallel)
        # Every cluster builds the same initial model (same seed, on the CPU); only the data differs.
        self.model = build_model(config.model, self.data.vocab_size, config.seed).to(self.compute.device)
        if config.parallel.activation_checkpoint != "none":
            checkpoint_blocks(self.model, config.parallel.activation_checkpoint)
        if config.parallel.compile == "blocks":
            compile_blocks(self.model, self.compute.device)
        self.optimizer = make_inner_optimizer(config, self.model.parameters())
        self.step = 0
        self.tokens_seen = 0

    @property
    def trained_module(self) -> torch.nn.Module:
        return self.model

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.model.named_parameters())

    def param_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, tuple(p.shape)) for name, p in self.model.named_parameters()]

    def lr_at(self, step: int) -> float:
        return inner_lr(self.config, step)

    def train_steps(self, n: int) -> tuple[float, int, float]:
        """Run `n` inner AdamW steps; returns (mean train loss, tokens trained, seconds)."""
        started = time.perf_counter()
        self.model.train()
        total_loss = 0.0
        tokens = 0
        for _ in range(n):
            loss, batch_tokens = self.train_step()
            total_loss += loss
            tokens += batch_tokens
        self.tokens_seen += tokens
        return total_loss / max(1, n), tokens, time.perf_counter() - started

    def train_step(self, reduce_gradients: Callable[[], None] | None = None) -> tuple[float, int]:
        """One inner AdamW step (scheduled lr, `grad_accum` micro-batches, clipping); returns (train
        loss, tokens).

        `reduce_gradients` runs between backward and clipping: where the data-parallel AllReduce
        baseline (bench/allreduce_baseline.py) averages the gradients across sites."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        accum = self.config.inner.grad_accum
        device = self.compute.device
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        tokens = 0
        for _ in range(accum):
            x, y = self.sampler.next_batch()
            with self.compute.autocast():
                loss = lm_loss(self.model, x.to(device), y.to(device))
            (loss / accum).backward()
            total += loss.detach()
            tokens += x.numel()
        if reduce_gradients is not None:
            reduce_gradients()
        if self.config.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.inner.grad_clip)
        self.optimizer.step()
        self.step += 1
        return float(total) / accum, tokens

    def evaluate(self) -> float:
        with self.compute.autocast():
            return evaluate_run(self.model, self.config, self.eval_data)
