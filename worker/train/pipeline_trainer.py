"""The local half of DiLoCo for one rank of a pipeline-parallel cluster (PP × DP over NCCL or gloo).

Same contract as `InnerTrainer` (named_parameters / train_steps / evaluate), so the round loop does not
care how the cluster computes. Each inner step runs the batch through PyTorch's own
`torch.distributed.pipelining` schedule (GPipe or 1F1B) in micro-batches; replicas of a stage then
average their gradients over the stage's data-parallel group; the gradient norm is clipped over the
whole model (squared norms summed across stages), exactly as a single process would; then each rank's
AdamW steps its own stage. A rank only ever holds its stage's parameters and optimiser state.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dilocox.common.config.run import RunConfig
from dilocox.worker.data.corpus import BatchSampler, as_token_array, check_split, eval_windows, gather_windows
from dilocox.worker.data.token_data import EVAL_FRACTION, TokenData
from dilocox.worker.models.contract import causal_lm_loss
from dilocox.worker.train.device import Compute
from dilocox.worker.train.inner_trainer import CheckpointableTrainer, inner_lr, make_inner_optimizer
from dilocox.worker.train.parallel_layout import ParallelLayout
from dilocox.worker.train.pipeline_stage import build_stage

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
_loss_fn = causal_lm_loss


class PipelineTrainer(CheckpointableTrainer):
    def __init__(
        self,
        config: RunConfig,
        corpus: bytes,
        layout: ParallelLayout,
        pipeline_group: dist.ProcessGroup,
        replica_group: dist.ProcessGroup,
        cluster_index: int = 0,
        num_clusters: int = 1,
        compute: Compute | None = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.pipeline_group = pipeline_group
        self.replica_group = replica_group
        self.compute = compute or Compute(torch.device("cpu"), bf16=False)
        self.device = self.compute.device
        dp = layout.dp
        data = corpus if isinstance(corpus, TokenData) else TokenData.from_bytes(corpus, EVAL_FRACTION)
        check_split(len(data.train), len(data.eval), config.model.block_size, num_clusters * dp)
        self.eval_data = as_token_array(data.eval)
        self.module = build_stage(config.model, data.vocab_size, config.seed, layout.stage, layout.pp).to(self.device)
        # Every stage of a replica draws the same batches (the first needs x, the last y); replicas of a
        # cluster each get their own part of the cluster's data.
        self.sampler = BatchSampler(data.train, config.model.block_size, config.inner.batch_size, config.seed,
                                    cluster_index * dp + layout.replica, num_clusters * dp, split=config.data_split)  # fmt: skip
        self.stage = PipelineStage(self.module, layout.stage, layout.pp, self.device, group=pipeline_group)
        schedule_cls = SCHEDULES[config.parallel.schedule]
        self.schedule = schedule_cls(self.stage, config.parallel.microbatches, loss_fn=_loss_fn)
        self.optimizer = make_inner_optimizer(config, self.module.parameters())
        self.step = 0
        self.tokens_seen = 0

    # ------------------------------------------------------------------ LocalTrainer
    @property
    def trained_module(self) -> torch.nn.Module:
        return self.module

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.module.named_parameters())

    def train_steps(self, n: int) -> tuple[float, int, float]:
        """Run `n` pipelined inner steps; returns (mean train loss, tokens the whole cluster trained, seconds)."""
        started = time.perf_counter()
        self.module.train()
        total_loss = 0.0
        accum = self.config.inner.grad_accum
        for _ in range(n):
            for group in self.optimizer.param_groups:
                group["lr"] = inner_lr(self.config, self.step)
            self.optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            for _micro in range(accum):
                x, y = self.sampler.next_batch()
                with self.compute.autocast():
                    self._forward_backward(x, y, losses)
            if accum > 1:
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(accum)
            self._average_replica_grads()
            self._clip_global_grad_norm()
            self.optimizer.step()
            total_loss += self._pipeline_mean_loss(losses)
            self.step += 1
        tokens = n * accum * self.sampler.tokens_per_batch * self.layout.dp
        self.tokens_seen += tokens
        return total_loss / max(1, n), tokens, time.perf_counter() - started

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, losses: list[torch.Tensor]) -> None:
        """One batch through the schedule (micro-batched); the last stage appends its losses."""
        if self.module.is_first and self.module.is_last:
            loss = _loss_fn(self.module(x.to(self.device)), y.to(self.device))
            loss.backward()
            losses.append(loss.detach())
        elif self.module.is_first:
            self.schedule.step(x.to(self.device))
        elif self.module.is_last:
            self.schedule.step(target=y.to(self.device), losses=losses)
        else:
            self.schedule.step()

    def evaluate(self) -> float:
        """Mean eval loss of the whole model, the same fixed windows as the single-process trainer."""
        cfg = self.config
        was_training = self.module.training
        self.module.eval()
        starts = eval_windows(len(self.eval_data), cfg.model.block_size, cfg.inner.batch_size * cfg.eval_batches)
        total = torch.zeros((), dtype=torch.float64)
        batches = 0
        ranks = self.layout.pipeline_ranks()
        me = ranks.index(dist.get_rank())
        with torch.no_grad(), self.compute.autocast():
            for i in range(0, len(starts), cfg.inner.batch_size):
                block = gather_windows(self.eval_data, starts[i : i + cfg.inner.batch_size].numpy(), cfg.model.block_size + 1)
                x, y = block[:, :-1], block[:, 1:]
                h = x.to(self.device) if self.module.is_first else self._recv_hidden(ranks[me - 1], x.shape)
                out = self.module(h)
                if self.module.is_last:
                    total += float(_loss_fn(out, y.to(self.device)))
                else:  # fp32 between stages whatever autocast computed in
                    dist.send(out.float().contiguous(), dst=ranks[me + 1], group=self.pipeline_group)
                batches += 1
        dist.broadcast(total, src=ranks[-1], group=self.pipeline_group)
        self.module.train(was_training)
        return float(total) / max(1, batches)

    # ------------------------------------------------------------------ collectives
    def _recv_hidden(self, src: int, idx_shape: torch.Size) -> torch.Tensor:
        hidden = torch.empty(*idx_shape, self.module.hidden_size, device=self.device)
        dist.recv(hidden, src=src, group=self.pipeline_group)
        return hidden

    def _average_replica_grads(self) -> None:
        if self.layout.dp == 1:
            return
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.replica_group)
                p.grad.div_(self.layout.dp)

    def _clip_global_grad_norm(self) -> None:
        max_norm = self.config.inner.grad_clip
        if max_norm <= 0:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squared = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            squared += g.detach().float().square().sum()
        if self.layout.pp > 1:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.pipeline_group)
        total_norm = squared.sqrt()
        scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)

    def _pipeline_mean_loss(self, losses: list[torch.Tensor]) -> float:
        """The step's loss, known on the last stage, shared with the whole pipeline (for logs)."""
        value = torch.tensor(float(torch.stack(losses).detach().mean()) if losses else 0.0)
        if self.layout.pp > 1:
            dist.broadcast(value, src=self.layout.pipeline_ranks()[-1], group=self.pipeline_group)
        return float(value)
