"""What a site's layout needs, per rank, before anything is built: the one model of memory that `dilocox
plan`, the worker's size guard and the API's use.

Everything is counted from the model's structure on the meta device (exact parameter counts per stage and
per rank, FSDP2's row chunks) and the layout; the terms follow what torch's engines allocate, as read in
their code and measured on gloo (`dilocox plan --measure`, tests/test_memory_plan.py):

Device, per GPU (on the CPU the same bytes are host memory):
* `weights`, `grads`, `optimizer`: FSDP2's sharded fp32 parameters, their sharded gradients and AdamW's two
  moments — 4 + 4 + 8 B per element this rank holds (its Shard(0) rows; all rows unsharded); with
  `--optimizer-state bf16` the moments are 4 B, with `int8` 2 B and a scale per block of a row (1-D and narrow
  tensors keep fp32 moments: worker/train/light_adamw.py).
* `gathered`: parameters FSDP2 has all-gathered for compute (bf16 or fp32); without FSDP (dp 1) in bf16,
  autocast's bf16 copy of the weights, which autograd saves for the backward (with `--activation-checkpoint
  full`: the root's and the recomputed block's); 1.25 GB of a Llama 1B's peak on an H200 the plan missed. Unpipelined,
  or pipelined with
  `--pipeline-reshard microbatch`: the root unit (embeddings, head, final norm) and two blocks (the one
  computing and the next, prefetched). Pipelined with `step`: every block of the stage stays gathered
  from its first forward to the end of the step's backward (worker/site/parallelize.py) — the whole stage.
* `grad_accumulators`: unsharded fp32 gradients before FSDP's reduce-scatter. Pipelined with `step`:
  torch's schedule turns gradient sync off for every microbatch but the last, so FSDP2 keeps the whole
  stage's unsharded gradients through the step. Otherwise one block's and the root's, transiently.
* `activations`: what autograd saves per token and layer (`ACTIVATION_FACTORS`), times the microbatches
  in flight of each of the rank's stages as torch's schedule holds them (worker/site/pipeline_memory.py:
  GPipe all of them; 1F1B pp − stage; interleaved 1F1B read off torch's own action list; unpipelined: the
  rank's whole batch), in the compute
  dtype; plus the attention matrix where attention is not fused (the CPU's math kernel). With
  `--activation-checkpoint full` a block keeps only its input per token, and one block's intermediates
  exist at a time while it is recomputed.
* `logits`: the last stage's logits, one set per microbatch in flight. fp32: plus the loss's two fp32
  transients (its log-softmax, its gradient). bf16: plus their bf16 gradient and the chunked loss's
  pieces (worker/models/chunked_loss.py: about five 64 MiB fp32 pieces at a time, never a whole fp32 copy).
* `reshard`: the two flat buffers the round boundary's all_to_all keeps (worker/site/reshard.py), sized by
  its own planner for this rank (worker/site/reshard_memory.py).
* `pipeline_buffers`: torch's pipelining allocates, when a stage first runs, a receive buffer per
  microbatch of the step for the activations it is sent (every stage but the first) and for the gradients
  it is sent back (every stage but the last), kept for the run, and the eval schedule's forward buffers
  (worker/site/trainer.py runs eval through a schedule of its own).
* `optimizer_step`: AdamW's transient: none for torch's fused kernel (fp32 on GPUs); on the CPU torch's
  per-tensor path copies one tensor at a time; light state computes each parameter's moments in fp32, one
  parameter at a time (compiled on GPUs: the two moments; eager on the CPU: a dozen temporaries).

* `workspace` (GPUs): cuBLAS's workspaces, taken from the caching allocator (`CUBLAS_WORKSPACE_BYTES`).

Beside these tensors, what the caching allocator never sees, on GPUs only (`overheads`): the CUDA context
and NCCL's buffers for the site's communicators (`CUDA_CONTEXT_BYTES`), and the allocator's fragmentation
(`FRAGMENTATION` of the tensors' peak, with `expandable_segments`, which the worker sets). A plan fits when
tensors and overheads together stay within the GPU; `margin` is what is left.

Host, per rank: `build` (one whole parameter while materialising, worker/models/materialize.py), `exchange`
(the round's flat buffers, replica, momentum and residual per owned parameter: worker/exchange/; 4 B less
with the start spilled to disk, `spill_dir`), and `checkpoint` (the residuals, and with
`checkpoint_staging = "async"` the DCP staging copy of weights and AdamW state — on the first replica of
replicated state only — which the site keeps for the next checkpoint; "sync" stages none of it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from dilocox.common.config.run import RunConfig
from dilocox.worker.models.chunked_loss import chunk_rows
from dilocox.worker.site.mesh import SiteShape
from dilocox.worker.site.model_shape import ModelShape, model_shape
from dilocox.worker.site.parallelize import checkpointed_blocks
from dilocox.worker.site.pipeline_memory import in_flight_layers, last_stage_in_flight
from dilocox.worker.site.reshard import BATCH_ELEMENTS, held_rows
from dilocox.worker.site.reshard_memory import BoundedReshardSizing, ExactReshardSizing
from dilocox.worker.train.light_adamw import moment_bytes

GB = 1e9
# Outside the caching allocator, per GPU: the CUDA context (~0.5 GB) and NCCL's buffers and streams for the
# site's communicators (world, pipeline, FSDP shard group, stage group: several channels × peers × 4 MiB
# each), allowed for as one figure (what torchtitan's and Megatron's users report at 8–64 GPUs: 1.5–3 GB).
CUDA_CONTEXT_BYTES = int(3 * GB)
# cuBLAS's workspaces, which torch takes from the caching allocator (so `max_memory_allocated` counts them):
# 32 MiB per (handle, stream) on Hopper, a handle per thread — the forward's, autograd's backward thread's,
# and one more (eval, the optimizer). Measured on an H200: 83 MB of a 25.6M-parameter rank's peak that no
# tensor term explained (docs/performance.md, "The plan against a GPU").
CUBLAS_WORKSPACE_BYTES = 3 * 32 * 2**20
# The caching allocator's fragmentation with `expandable_segments:True` (which the worker sets): reserved
# above allocated, as a share of the allocated peak. Without it ~6 % is typical of FSDP runs.
FRAGMENTATION = 0.03
# Per token and layer, the elements autograd keeps for a pre-norm transformer block (norm outputs, q/k/v,
# attention output, the projections' inputs, the MLP's hidden activations), as (× width, × MLP width):
# measured after a forward of the built-in GPT (GELU MLP) and of a Llama layer (gated SiLU MLP: gate, up,
# their product and the activation), fp32 on the CPU, within 4 % (tests/test_memory_plan.py).
ACTIVATION_FACTORS = {False: (4, 2), True: (7, 4)}  # gated MLP? -> (width, mlp)
# Exchange bytes per owned parameter: start 4, outgoing (Δ + e, the residual between rounds) 4, replica 4,
# momentum 4 (worker/exchange/host_buffers.py, outgoing.py, docs/decisions.md); the low-rank warm starts
# are counted apart, and θ reaches the host through a landing buffer of at most one reshard batch.
EXCHANGE_BYTES_PER_PARAM = 16
SPILLED_BYTES_PER_PARAM = 4  # the start, in a file on local disk between boundaries (`spill_dir`)
CHECKPOINT_BYTES_PER_OWNED = 4  # the residuals (the replica is written from its live tensors: worker/checkpoint.py)


def exchange_bytes_per_param(parallel) -> int:  # noqa: ANN001
    """Host bytes the exchange keeps per owned parameter for this site's settings (a ParallelConfig)."""
    return EXCHANGE_BYTES_PER_PARAM - (SPILLED_BYTES_PER_PARAM if parallel.spill_dir else 0)


@dataclass
class RankPlan:
    rank: int
    stage: int
    replica: int
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    held: int = 0  # parameter elements this rank holds (its shard)
    owned: int = 0  # parameter elements whose exchange this rank runs

    overheads: dict[str, int] = field(default_factory=dict)  # beside the tensors, on a GPU

    @property
    def device_total(self) -> int:
        """The tensors' bytes: what `torch.cuda.max_memory_allocated` measures."""
        return sum(self.device.values())

    @property
    def device_need(self) -> int:
        """Tensors and the overheads beside them: what the GPU must hold."""
        return self.device_total + sum(self.overheads.values())

    @property
    def host_steady(self) -> int:
        return self.host["exchange"]

    @property
    def host_peak(self) -> int:
        return max(self.host["build"], self.host["exchange"] + self.host["checkpoint"])


@dataclass
class MemoryPlan:
    model: str
    params: int
    shape: SiteShape
    ranks: list[RankPlan]
    gpu_bytes: int | None
    bf16: bool
    pipeline_reshard: str  # "step" or "microbatch" (auto resolved)
    spilled: bool = False  # the start on local disk (`spill_dir`)
    checkpoint_staging: str = "async"
    optimizer_state: str = "fp32"

    @property
    def peak_device(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.device_need)

    def fits(self) -> bool:
        return self.gpu_bytes is None or self.peak_device.device_need <= self.gpu_bytes

    checkpoint_bytes: int = 0  # one site checkpoint on disk (`checkpoint_disk_bytes`; 0 in a quick plan)

    def checkpoint_disk(self, keep: int = 2) -> int:
        """The disk a run's checkpoints take: `keep` committed ones and the next being written."""
        return (keep + 1) * self.checkpoint_bytes

    @property
    def margin(self) -> int | None:
        """What the fullest GPU has left once tensors and overheads are in (negative: over)."""
        return None if self.gpu_bytes is None else self.gpu_bytes - self.peak_device.device_need

    def binding(self) -> str:
        """The largest term of the fullest GPU: what to change first."""
        worst = self.peak_device
        term = max(worst.device, key=worst.device.get)
        return f"{term} ({worst.device[term] / GB:.1f} GB on rank {worst.rank}, stage {worst.stage})"


def planned_precision(config: RunConfig, on_gpu: bool) -> RunConfig:
    """`auto` planned as the worker resolves it: bf16 on GPUs (compute capability ≥ 8 is assumed), fp32
    on the CPU."""
    par = config.parallel
    if par.precision != "auto":
        return config
    return dataclasses.replace(config, parallel=dataclasses.replace(par, precision="bf16" if on_gpu else "fp32"))


def _held_summary(model: ModelShape, stage: int, shard: int, shards: int, state: str) -> tuple[int, int, int]:
    """(elements held, the largest parameter's, AdamW's moment bytes) of a rank holding FSDP chunk `shard`
    of `shards` of `stage` — kept on the shape, which the layout search plans hundreds of times."""
    key = (stage, shard, shards, state)
    if key not in model.memo:
        shapes = dict(model.stages[stage])
        by_tensor = _held_by_tensor(shapes, shard, shards)
        moments = sum(moment_bytes(shapes[name], n, state) for name, n in by_tensor.items())
        model.memo[key] = (sum(by_tensor.values()), max(by_tensor.values(), default=0), moments)
    return model.memo[key]


def _held_by_tensor(shapes: dict[str, tuple[int, ...]], shard: int, shards: int) -> dict[str, int]:
    """Elements of each parameter a rank holds: its Shard(0) rows of `shards`."""
    held = {}
    for name, shape in shapes.items():
        rows = shape[0] if shape else 1
        start, stop = held_rows(rows, shard, shards)
        held[name] = (stop - start) * (math.prod(shape[1:]) if len(shape) > 1 else 1)
    return held


def _optimizer_step_bytes(state: str, cuda: bool, held: int, largest_local: int) -> int:
    """AdamW's transient at its step (module docstring): fused fp32 on a GPU none; the CPU's per-tensor
    fp32 path one tensor's copy; light state each parameter's moments in fp32 (compiled on a GPU), or
    eager on the CPU its temporaries (measured with --measure on gloo: ~10 fp32 copies and torchao's
    int64 codes while it quantises)."""
    if state == "fp32":
        return 0 if cuda else 4 * largest_local
    if cuda:
        return 8 * largest_local
    return (48 if state == "int8" else 32) * largest_local


def resolve_pipeline_reshard(
    config: RunConfig,
    vocab: int,
    gpu_bytes: int | None,
    fused_attention: bool = True,
    model: ModelShape | None = None,
    quick: bool = False,
) -> RunConfig:
    """`--pipeline-reshard auto` made concrete: "step" (fewest collectives) unless the plan says the
    stage's gathered blocks and gradients do not fit the GPU, then "microbatch". Without a GPU size (the
    CPU) or without pipelined FSDP, "step"."""
    par = config.parallel
    if par.pipeline_reshard != "auto":
        return config
    if par.schedule == "interleaved-zb":  # its split backward runs with blocks gathered through the step
        return dataclasses.replace(config, parallel=dataclasses.replace(par, pipeline_reshard="step"))
    step = dataclasses.replace(config, parallel=dataclasses.replace(par, pipeline_reshard="step"))
    if (
        gpu_bytes is None
        or par.pp == 1
        or par.dp == 1
        or plan_memory(step, vocab, gpu_bytes, fused_attention, model, quick=quick).fits()
    ):
        return step
    return dataclasses.replace(config, parallel=dataclasses.replace(par, pipeline_reshard="microbatch"))


def plan_memory(
    config: RunConfig,
    vocab: int,
    gpu_bytes: int | None = None,
    fused_attention: bool = True,
    model: ModelShape | None = None,
    batch_elements: int = BATCH_ELEMENTS,
    quick: bool = False,
) -> MemoryPlan:
    """Every rank's planned bytes for `config`'s layout (see the module docstring). `fused_attention`:
    SDPA's flash/memory-efficient kernels (GPUs) keep no attention matrix; the CPU's math kernel does.
    `quick`: the layout search's form — one rank per stage, its first replica (which holds the most rows:
    FSDP gives the first shards the larger chunks), with `BoundedReshardSizing`: never below the full plan."""
    model = model or model_shape(config, vocab)
    config = resolve_pipeline_reshard(config, vocab, gpu_bytes, fused_attention, model, quick)
    par, inner, block = config.parallel, config.inner, config.model.block_size
    shape = SiteShape.of(par)
    bf16 = par.precision == "bf16"
    param_bytes = 2 if bf16 else 4
    act_bytes = 2 if bf16 else 4
    sharded = shape.dp > 1  # FSDP2 applied (mesh.fsdp_mesh is not None)
    pipelined = shape.pp > 1
    cuda = par.device != "cpu"
    ranks = []
    if quick:  # the same owners for every candidate of a stage count and dp: planned once
        key = ("bounded", shape.dp, sharded, batch_elements)
        if key not in model.memo:
            model.memo[key] = [BoundedReshardSizing(specs, shape, sharded, batch_elements) for specs in model.stages]
        reshards = model.memo[key]
    else:
        reshards = [ExactReshardSizing(specs, shape, sharded, batch_elements) for specs in model.stages]
    for rank in [s * shape.dp for s in range(shape.pp)] if quick else range(shape.world_size):
        stage, replica = shape.stage_of(rank), shape.replica_of(rank)
        shapes = dict(model.stages[stage])
        stage_params = sum(math.prod(s) for s in shapes.values())
        blocks = model.blocks[stage]
        root = stage_params - sum(blocks)
        held, largest_local, moments = _held_summary(
            model, stage, shape.shard_coordinate(replica), shape.dp_shard if sharded else 1, par.optimizer_state
        )
        plan = RankPlan(rank, stage, replica, held=held)
        d = plan.device
        d["weights"], d["grads"] = 4 * held, 4 * held
        d["optimizer"] = moments
        largest_block = max(blocks, default=0)
        checkpointed = checkpointed_blocks(blocks, par.activation_checkpoint)
        if not sharded:  # no FSDP: bf16 is autocast, whose bf16 copy of each weight autograd keeps for backward
            # (the whole stage's, the embedding counted too; checkpointed blocks keep none but the one recomputed)
            cast = stage_params - sum(checkpointed) + (2 * largest_block if checkpointed else 0)
            d["gathered"], d["grad_accumulators"] = (2 * cast if bf16 else 0), 0
        elif pipelined and par.pipeline_reshard == "step":
            d["gathered"], d["grad_accumulators"] = param_bytes * stage_params, 4 * stage_params
        else:
            d["gathered"] = param_bytes * (root + 2 * largest_block)
            d["grad_accumulators"] = 4 * (root + largest_block)
        micro = par.microbatches if pipelined else 1
        tokens = inner.batch_size // micro * block
        micro *= inner.grad_accum if pipelined else 1  # a step's accumulated batches go through one schedule step
        chunks = model.layers_of_chunks(stage)  # the blocks of each of the rank's stages
        # blocks × microbatches held at once (worker/site/pipeline_memory.py: as torch's schedule runs)
        in_flight = in_flight_layers(par.schedule, stage, shape.pp, micro, chunks) if pipelined else len(blocks)
        width_factor, mlp_factor = ACTIVATION_FACTORS[model.gated]
        per_token_layer = width_factor * model.width + mlp_factor * model.mlp
        if not fused_attention:
            per_token_layer += 2 * model.heads * block  # the attention probabilities and their dropout/softmax copy
        # A checkpointed block keeps its input, the others every intermediate; one checkpointed block's
        # intermediates are rebuilt at a time (selective: blocks 0, 2, 4, … of the rank are the checkpointed ones).
        kept = len(checkpointed) * model.width + (len(blocks) - len(checkpointed)) * per_token_layer
        rebuilt = tokens * per_token_layer if checkpointed else 0
        d["activations"] = (in_flight * tokens * kept // max(1, len(blocks)) + rebuilt) * act_bytes
        last = stage == shape.pp - 1
        last_in_flight = last_stage_in_flight(par.schedule, shape.pp, micro, par.stages_per_rank) if pipelined else 1
        d["logits"] = _logits_bytes(tokens, model.vocab, last_in_flight, bf16) if last else 0
        # Receive buffers, one per microbatch of the step (and of eval) and per stage of the rank: the
        # activations it is sent (all stages of the model but its first), their gradients (all but its last).
        micro_tokens = tokens * model.width * act_bytes
        virtual = shape.pp * par.stages_per_rank
        stage_indices = [stage + k * shape.pp for k in range(par.stages_per_rank)]
        receives = sum((s > 0) * (micro + par.microbatches) + (s < virtual - 1) * micro for s in stage_indices)
        d["pipeline_buffers"] = receives * micro_tokens if pipelined else 0
        reshard = reshards[stage]
        d["reshard"] = 4 * reshard.buffers[replica] if shape.dp > 1 else 0
        d["optimizer_step"] = _optimizer_step_bytes(par.optimizer_state, cuda, held, largest_local)
        if cuda:
            d["workspace"] = CUBLAS_WORKSPACE_BYTES
            plan.overheads = {
                "cuda_context": CUDA_CONTEXT_BYTES,
                "fragmentation": int(FRAGMENTATION * plan.device_total),
            }
        owned_names = reshard.owned(shapes, replica)
        owned = sum(math.prod(shapes[n]) for n in owned_names)
        plan.owned = owned
        warm = sum(shapes[n][1] * config.compress.rank_max * 4 for n in owned_names if len(shapes[n]) == 2)
        largest = max((math.prod(s) for s in shapes.values()), default=0)
        plan.host = {
            "build": 5 * largest,  # the whole parameter drawn, and its NaN check's mask
            # + θ's landing buffer on the host: at most one reshard batch of this rank's rows, kept between
            # boundaries (with the start spilled, a lean site frees it after each: worker/site/reshard.py)
            "exchange": exchange_bytes_per_param(par) * owned
            + warm
            + 4 * reshard.landing[replica] * (not par.spill_dir),
            # Replicated state is staged by the first replica alone (worker/checkpoint.py, written_once).
            "checkpoint": (
                (4 * held + d["optimizer"])
                * (shape.replicate_coordinate(replica) == 0)
                * (par.checkpoint_staging == "async")
                + CHECKPOINT_BYTES_PER_OWNED * owned
            ),
        }
        ranks.append(plan)
    return MemoryPlan(
        config.model.model,
        model.params,
        shape,
        ranks,
        gpu_bytes,
        bf16,
        config.parallel.pipeline_reshard,
        bool(par.spill_dir),
        par.checkpoint_staging,
        par.optimizer_state,
        0 if quick else checkpoint_disk_bytes(model, par.optimizer_state),
    )


def checkpoint_disk_bytes(model: ModelShape, optimizer_state: str) -> int:
    """One site checkpoint's bytes: fp32 weights and AdamW's moments as kept (replicas write them once), and
    per parameter the error-feedback residual and the replica of the global model — weights and outer
    momentum (worker/checkpoint.py): 4 + moments + 12 B a parameter."""
    return sum(
        4 * math.prod(s) + moment_bytes(s, math.prod(s), optimizer_state) + 12 * math.prod(s)
        for stage in model.stages
        for _, s in stage
    )


def _logits_bytes(tokens: int, vocab: int, in_flight: int, bf16: bool) -> int:
    """The last stage's logits and the loss's transients (measured with torch's MemTracker in
    tests/test_chunked_loss.py: the plain loss three fp32 copies, the chunked one the bf16 gradient and
    five pieces)."""
    if not bf16:
        return tokens * vocab * 4 * (in_flight + 2)
    pieces = 5 * min(tokens, chunk_rows(vocab)) * vocab * 4
    return tokens * vocab * 2 * (in_flight + 1) + pieces
