"""The local half of DiLoCo for one rank of a site: its stage (or the whole model), sharded by FSDP2 over
the stage's dp ranks, pipelined with `torch.distributed.pipelining` across stages, and its inner AdamW.

Same contract as `InnerTrainer` (named_parameters / train_steps / evaluate), so the round loop does not
care how the site computes. One inner step:

* every replica's pipeline draws its own batch (each stage of a pipeline the same one: the first needs
  the inputs, the last the targets) — `grad_accum` batches per step, each split into `microbatches`;
* pp > 1: torch's schedule (GPipe or 1F1B) runs the micro-batches, all `grad_accum · microbatches` of a
  step in one schedule step (one gather and one reduce of each block per step, not per batch). Its own
  gradient scaling is off (`scale_grads=False`): it would divide *all* of `.grad` by the micro-batch count at every
  `step()`,
  so a second accumulated batch would divide the first again. The gradient of the whole step's batch is
  taken once, at the end: ÷ (grad_accum · microbatches);
* pp = 1: plain forward and backward, FSDP's gradient sync only on the last accumulated batch;
* FSDP averages the gradients over the stage's dp ranks (its reduce-scatter), so the step's gradient is
  that of the site's whole batch, exactly as one process would compute it;
* the norm is clipped over the whole model: squared norms of each rank's shard, summed over the shard
  group and the pipeline, on the device;
* AdamW steps the rank's shard.

Every collective here runs on the device (NCCL needs CUDA tensors): the reported loss and the eval
total are device tensors until the last moment.
"""

from __future__ import annotations

import contextlib
import time

import structlog
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from dilocox.common.config.run import RunConfig
from dilocox.worker.data.corpus import (
    BatchSampler,
    as_token_array,
    check_split,
    data_part,
    eval_windows,
    gather_windows,
)
from dilocox.worker.data.token_data import EVAL_FRACTION, TokenData
from dilocox.worker.models.build import blueprint
from dilocox.worker.models.contract import causal_lm_loss, logits_of
from dilocox.worker.models.materialize import materialize
from dilocox.worker.models.weights import load_weights
from dilocox.worker.site.mesh import SiteMesh
from dilocox.worker.site.parallelize import checkpoint_blocks, local_part, reshard_all, shard_stage
from dilocox.worker.site.pipeline_fsdp import MicrobatchReshardStage
from dilocox.worker.train.block_compile import compile_blocks
from dilocox.worker.train.inner_trainer import inner_lr, make_inner_optimizer
from dilocox.worker.train.pipeline_stage import RankStages, rank_stages, split_model, stage_modules

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE_SCHEDULES = {"interleaved-1f1b": ScheduleInterleaved1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble}
log = structlog.get_logger()


def smallest_gpu(mesh: SiteMesh, mine: int | None) -> int | None:
    """The smallest GPU memory over the site's ranks (None on the CPU), agreed on the host."""
    smallest = torch.tensor([mine or 0], dtype=torch.int64)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=mesh.agreement_group)
    return int(smallest.item()) or None


def pipeline_reshard_of(config: RunConfig, vocab_size: int, mesh: SiteMesh) -> str:
    """This site's `--pipeline-reshard`, `auto` resolved by the memory plan against the smallest GPU of the
    site — agreed over its ranks, so that ranks on GPUs of different sizes never choose differently (their
    collectives would then not match, and the site would hang); "step" on the CPU."""
    from dilocox.worker.site.memory_plan import planned_precision, resolve_pipeline_reshard  # one rule, the plan's

    if config.parallel.pipeline_reshard != "auto":
        return config.parallel.pipeline_reshard
    gpu = smallest_gpu(
        mesh, torch.cuda.get_device_properties(mesh.device).total_memory if mesh.compute.is_cuda else None
    )
    planned = planned_precision(config, on_gpu=gpu is not None)
    choice = resolve_pipeline_reshard(planned, vocab_size, gpu).parallel.pipeline_reshard
    if mesh.rank == 0 and mesh.shape.pp > 1 and mesh.shape.dp > 1:
        log.info("pipeline_reshard_chosen", choice=choice, smallest_gpu_gb=round(gpu / 1e9, 1) if gpu else None)
    return choice


def build_site_module(
    config: RunConfig, vocab_size: int, mesh: SiteMesh, pipeline_reshard: str = "step"
) -> torch.nn.Module:
    """This rank's part of the run's initial model, built sharded: the model's meta blueprint, cut to this
    rank's stage, FSDP2-sharded while still on meta, then only this rank's rows are made on its device —
    from the run's seed, bit-identical to one process (worker/models/materialize.py), or read from
    `--weights`. A `module:function` model (its init its own code's) is built whole and then sharded."""
    plan = blueprint(config.model, vocab_size, config.seed)
    pp, per_rank = mesh.shape.pp, config.parallel.stages_per_rank
    if pp == 1:
        module = plan.module
    elif per_rank == 1:
        module = split_model(plan.module, mesh.stage, pp)
    else:  # this rank's stages of pp · v, together under the model's names (each one its own FSDP root)
        module = RankStages([split_model(plan.module, s, pp * per_rank) for s in rank_stages(mesh.stage, pp, per_rank)])
    if plan.built:
        module = module.to(mesh.device)
    if config.parallel.activation_checkpoint != "none":
        checkpoint_blocks(module, config.parallel.activation_checkpoint)
    if config.parallel.compile == "blocks":
        compile_blocks(module, mesh.device)
    if mesh.fsdp_mesh is not None:
        for part in stage_modules(module):
            shard_stage(part, mesh.fsdp_mesh, mesh.compute.bf16, keep_gathered=pp > 1 and pipeline_reshard == "step")
    if not plan.built:
        materialize(module, mesh.device, config.seed, plan.init_fn, plan.skeleton, fill=not config.model.weights)
        torch.manual_seed(config.seed)  # what draws next (dropout) starts from the seed, as in one process
    if config.model.weights:
        load_weights(module, config.model.weights)
    return module


class SiteTrainer:
    def __init__(
        self, config: RunConfig, data: TokenData | bytes, mesh: SiteMesh, cluster_index: int = 0, num_clusters: int = 1
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.compute = mesh.compute
        self.device = mesh.device
        shape = mesh.shape
        data = data if isinstance(data, TokenData) else TokenData.from_bytes(data, EVAL_FRACTION)
        part = data_part(config.data_split, config.seed, cluster_index, num_clusters, mesh.replica, shape.dp)
        check_split(len(data.train), len(data.eval), config.model.block_size, part.count)
        self.eval_data = as_token_array(data.eval)
        self.vocab_size = data.vocab_size
        self.sharded = mesh.fsdp_mesh is not None
        self.pipeline_reshard = pipeline_reshard_of(config, data.vocab_size, mesh)
        self.module = build_site_module(config, data.vocab_size, mesh, self.pipeline_reshard)
        # bf16 without FSDP is autocast; with FSDP its mixed-precision policy does it.
        self._autocast = (lambda: contextlib.nullcontext()) if self.sharded else self.compute.autocast
        self.sampler = BatchSampler(
            data.train,
            config.model.block_size,
            config.inner.batch_size,
            part.seed,
            part.index,
            part.count,
            split=part.split,
        )
        self.schedule = self.eval_schedule = None
        if shape.pp > 1:
            self.schedule, self.eval_schedule = self._schedules()
        self.optimizer = make_inner_optimizer(config, self.module.parameters())
        self.step = 0
        self.tokens_seen = 0
        mesh.settle()  # ranks done building at different times meet on the host, not in a training collective

    def _schedules(self):  # noqa: ANN202
        """The training schedule and eval's. One schedule step per inner step: the accumulated batches'
        microbatches all go through one schedule (m·A of them), so FSDP gathers and reduces a block once per
        step, not once per batch. Eval has stages and a schedule of its own: torch re-runs a stage's shape
        inference (a round of metadata messages between stages) each time one schedule switches between
        step() and eval(). With several stages a rank, torch's interleaved 1F1B or zero-bubble schedule
        runs them (each stage a PipelineStage of its own), and eval the interleaved 1F1B forward only."""
        par, mesh = self.config.parallel, self.mesh
        micro, pp, per_rank = par.microbatches, mesh.shape.pp, par.stages_per_rank
        stage_class = MicrobatchReshardStage if self.pipeline_reshard == "microbatch" else PipelineStage
        parts, indices = stage_modules(self.module), rank_stages(mesh.stage, pp, per_rank)

        def make(cls):
            return [cls(part, i, pp * per_rank, self.device, group=mesh.pp_group) for part, i in zip(parts, indices)]

        steps = micro * self.config.inner.grad_accum
        if par.schedule in SCHEDULES:
            schedule = SCHEDULES[par.schedule](make(stage_class)[0], steps, loss_fn=causal_lm_loss, scale_grads=False)
            return schedule, ScheduleGPipe(make(PipelineStage)[0], micro, loss_fn=causal_lm_loss, scale_grads=False)
        schedule = MULTI_STAGE_SCHEDULES[par.schedule](
            make(stage_class), steps, loss_fn=causal_lm_loss, scale_grads=False
        )
        return schedule, ScheduleInterleaved1F1B(make(PipelineStage), micro, loss_fn=causal_lm_loss, scale_grads=False)

    # ------------------------------------------------------------------ LocalTrainer
    @property
    def trained_module(self) -> torch.nn.Module:
        return self.module

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The stage's parameters as this rank holds them: FSDP's sharded DTensors (every unit resharded
        first), or the plain tensors of an unsharded stage."""
        if self.sharded:
            for part in stage_modules(self.module):  # each stage's root unit too (a RankStages' tree has none)
                reshard_all(part)
        return list(self.module.named_parameters())  # a RankStages: its stages' parameters, by the model's names

    def train_steps(self, n: int) -> tuple[float, int, float]:
        """Run `n` inner steps; returns (mean train loss, tokens the whole site trained, seconds)."""
        started = time.perf_counter()
        self.module.train()
        total = torch.zeros((), device=self.device)
        accum = self.config.inner.grad_accum
        for _ in range(n):
            for group in self.optimizer.param_groups:
                group["lr"] = inner_lr(self.config, self.step)
            self.optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if self.schedule is not None:  # all accumulated batches through one schedule step
                batches = [self.sampler.next_batch() for _ in range(accum)]
                x, y = (torch.cat(parts).to(self.device) for parts in zip(*batches))
                self._forward_backward(x, y, losses, last=True)
            else:
                for i in range(accum):
                    x, y = self.sampler.next_batch()
                    self._forward_backward(x.to(self.device), y.to(self.device), losses, last=i == accum - 1)
            self._scale_grads(1.0 / (accum * (self.config.parallel.microbatches if self.schedule else 1)))
            self._clip_grad_norm()
            self.optimizer.step()
            if losses:
                total += torch.stack(losses).mean()
            self.step += 1
        if self.mesh.shape.dp > 1:  # the site's loss: the mean over its replicas' batches
            dist.all_reduce(total, group=self.mesh.stage_group)
            total /= self.mesh.shape.dp
        self._share_from_last_stage(total)
        tokens = n * accum * self.sampler.tokens_per_batch * self.mesh.shape.dp
        self.tokens_seen += tokens
        return float(total) / max(1, n), tokens, time.perf_counter() - started

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, losses: list[torch.Tensor], last: bool) -> None:
        """One batch: through the pipeline schedule (the last stage appends a loss per micro-batch) or
        straight through the model; gradients accumulate in `.grad`, unscaled."""
        if self.schedule is None:
            if self.sharded:
                self.module.set_requires_gradient_sync(last)  # reduce once, after the last accumulated batch
            with self._autocast():
                loss = causal_lm_loss(logits_of(self.module(x)), y)
            loss.backward()
            losses.append(loss.detach())
            return
        with self._autocast():
            losses.extend(loss.detach() for loss in self._through_pipeline(self.schedule.step, x, y))

    def _through_pipeline(self, run, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001
        """One batch through the schedule's `step` or `eval`, each stage given what it needs (the first
        the inputs, the last the targets); returns the micro-batches' losses on the last stage (none
        elsewhere). A fresh list each call: the schedule empties the one it is given."""
        losses: list[torch.Tensor] = []
        if self.mesh.is_first_stage:
            run(x, return_outputs=False)
        elif self.mesh.is_last_stage:
            run(target=y, losses=losses, return_outputs=False)
        else:
            run(return_outputs=False)
        return losses

    def _scale_grads(self, factor: float) -> None:
        if factor != 1.0:
            grads = [local_part(p.grad) for p in self.module.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, factor)

    def _clip_grad_norm(self) -> None:
        """Clip to `grad_clip` by the norm over the whole model, as one process would: each rank's shard
        counted once (summed over the shard group — not over replicas, which hold the same rows — and
        over the pipeline's stages)."""
        max_norm = self.config.inner.grad_clip
        if max_norm <= 0:
            return
        grads = [local_part(p.grad) for p in self.module.parameters() if p.grad is not None]
        squared = torch.nn.utils.get_total_norm(grads, 2.0).square() if grads else torch.zeros((), device=self.device)
        squared = squared.to(device=self.device, dtype=torch.float32)
        if self.sharded and self.mesh.shape.dp_shard > 1:
            dist.all_reduce(squared, group=self.mesh.shard_group)
        if self.mesh.shape.pp > 1:
            dist.all_reduce(squared, group=self.mesh.pp_group)
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, squared.sqrt())

    def _share_from_last_stage(self, value: torch.Tensor) -> None:
        """Losses are known on the last stage; every stage reports the same (a device tensor for NCCL)."""
        if self.mesh.shape.pp > 1:
            dist.broadcast(value, src=self.mesh.last_stage_rank(), group=self.mesh.pp_group)

    # ------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean eval loss of the whole model over the same fixed windows as the single-process trainer.
        Where the eval batches divide among the replicas, each replica's pipeline takes its share and the
        totals are summed over the stage's dp ranks; otherwise every replica runs them all."""
        cfg = self.config
        batches = cfg.eval_batches
        dp = self.mesh.shape.dp
        split = dp > 1 and batches % dp == 0
        mine = range(self.mesh.replica, batches, dp) if split else range(batches)
        starts = eval_windows(len(self.eval_data), cfg.model.block_size, cfg.inner.batch_size * batches).numpy()
        was_training = self.module.training
        self.module.eval()
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            for b in mine:
                block = gather_windows(
                    self.eval_data,
                    starts[b * cfg.inner.batch_size : (b + 1) * cfg.inner.batch_size],
                    cfg.model.block_size + 1,
                ).to(self.device)
                total += self._eval_batch(block[:, :-1], block[:, 1:])
        finally:
            self.module.train(was_training)
        self._share_from_last_stage(total)
        if split:
            dist.all_reduce(total, group=self.mesh.stage_group)
        return float(total) / batches

    def _eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This batch's mean loss on the last stage (zero elsewhere)."""
        with self._autocast():
            if self.schedule is None:
                return causal_lm_loss(logits_of(self.module(x)), y).float()
            losses = self._through_pipeline(self.eval_schedule.eval, x, y)
        return torch.stack(losses).mean().float() if losses else torch.zeros((), device=self.device)
