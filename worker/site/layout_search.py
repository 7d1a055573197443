"""`dilocox plan --gpus N`: the layouts of N GPUs that fit, ranked by an estimated speed that knows nodes.

Memory is the plan's (worker/site/memory_plan.py, its `quick` form: never below the full plan). Speed is a
stated model, for ranking layouts against each other rather than for promising a figure:

* **Compute**: the model's FLOPs per token — 6 per matmul parameter (the embedding lookup is none) and
  12 · layers · width · block for attention, as torchtitan counts them; with `--activation-checkpoint full`
  the forward runs twice (8 and 16) — at `mfu` of the GPU's dense bf16 peak (`gpu_tflops`).
* **The pipeline's bubble**: GPipe and 1F1B keep every stage busy for m of m + pp − 1 microbatch slots
  (m: the step's microbatches, accumulated batches included), the interleaved 1F1B with v stages a rank for
  v·m of v·m + pp − 1 (worker/site/pipeline_memory.py); the slowest rank sets the slot.
* **FSDP's traffic**, per rank and step over the link its shard group spans: all-gathers of the stage's
  parameters in the compute dtype and a reduce-scatter of its gradients in fp32, each moving (n − 1)/n of
  the stage per rank — once per step where blocks stay gathered (`--pipeline-reshard step`), per
  microbatch otherwise, per accumulated batch unpipelined; HSDP adds an all-reduce over the replicas.
  It overlaps compute (FSDP prefetches), so a step takes the longer of the two.
* **Stage-to-stage sends**: the bubble's fill and drain put pp − 1 activation sends and as many gradient
  sends on the critical path.

Placement is torchrun's: `--gpus-per-node` consecutive ranks share a node, rank = stage · dp + replica and
replica = r · dp_shard + s (worker/site/mesh.py). So a stage's FSDP shard group stays inside a node when
dp_shard divides the node, its HSDP replicas and its pipeline neighbours cross nodes once dp fills one —
the layouts torchtitan recommends (FSDP inside the node, pipeline across) rank first on their own merit.
Links: NVLink inside a node (`NVLINK_GBYTE_S`, an effective collective bandwidth), `node_link_gbit` per GPU
between nodes (one 400 Gbit/s NIC per GPU on DGX H100/H200 nodes).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from dilocox.common.config.run import RunConfig
from dilocox.worker.site.memory_plan import MemoryPlan, plan_memory
from dilocox.worker.site.mesh import SiteShape
from dilocox.worker.site.model_shape import ModelShape
from dilocox.worker.site.parallelize import CHECKPOINT_EVERY
from dilocox.worker.site.pipeline_memory import bubble_fraction, interleaved_rounds

NVLINK_GBYTE_S = 360.0  # an H100/H200's NVLink 4 (450 GB/s each way) as collectives see it
H100_BF16_TFLOPS = 989.0  # dense, no sparsity: H100 / H200 SXM


@dataclass(frozen=True)
class Cluster:
    """What the layouts run on."""

    gpus_per_node: int = 8
    node_link_gbit: float = 400.0  # per GPU, between nodes
    gpu_tflops: float = H100_BF16_TFLOPS
    mfu: float = 0.4  # the share of peak the matmuls reach

    def bandwidth(self, inside_node: bool) -> float:
        """Bytes per second a rank moves in a collective over that link."""
        return NVLINK_GBYTE_S * 1e9 if inside_node else self.node_link_gbit * 1e9 / 8


@dataclass(frozen=True)
class StepEstimate:
    seconds: float
    compute_s: float  # the pipeline's compute, bubble included
    fsdp_s: float  # FSDP's (and HSDP's) traffic, overlapped with compute
    sends_s: float  # stage-to-stage sends on the critical path
    bubble: float  # the share of a stage's slots it idles
    tokens: int  # the site's tokens per inner step
    model_flops: float  # per step, without recomputation (MFU's numerator)
    fsdp_inside_node: bool

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def mfu(self, gpus: int, cluster: Cluster) -> float:
        return self.model_flops / self.seconds / (gpus * cluster.gpu_tflops * 1e12)


def estimate_step(config: RunConfig, model: ModelShape, cluster: Cluster, reshard: str) -> StepEstimate:
    """The estimated inner step of `config`'s layout (module docstring); `model` split into its stages."""
    par, inner, block = config.parallel, config.inner, config.model.block_size
    shape = SiteShape.of(par)
    pipelined = shape.pp > 1
    micro = par.microbatches * inner.grad_accum if pipelined else inner.grad_accum  # the step's microbatches
    micro_tokens = inner.batch_size * block // (par.microbatches if pipelined else 1)
    every = CHECKPOINT_EVERY.get(par.activation_checkpoint)
    recompute = 1 / every if every else 0.0  # the share of the blocks recomputed in the backward
    layers = sum(len(b) for b in model.blocks)
    attention = 12 * model.width * block  # per token and layer, forward and backward
    embedding = sum(s[0] * s[1] for name, s in model.stages[0] if len(s) == 2 and name in _embeddings(model))
    stage_flops = []  # per token, forward and backward (and the recomputed forward)
    for specs, blocks in zip(model.stages, model.blocks):
        params = sum(_numel(s) for _, s in specs) - (embedding if specs is model.stages[0] else 0)
        stage_flops.append((6 + 2 * recompute) * params + len(blocks) * attention * (1 + recompute / 3))
    peak = cluster.gpu_tflops * 1e12 * cluster.mfu
    slot = max(stage_flops) * micro_tokens / peak  # one microbatch through a rank's stages, the slowest rank's
    bubble = bubble_fraction(shape.pp, micro, par.stages_per_rank, par.schedule)
    compute = slot * micro / (1 - bubble)
    # FSDP: one stage's shard group; the busiest (most parameters) stage sets the pace
    stage_params = max(sum(_numel(s) for _, s in specs) for specs in model.stages)
    param_bytes = 2 if par.precision == "bf16" else 4
    n, r = shape.dp_shard, shape.dp_replicate
    if shape.dp == 1:
        gathers, scatters = 0, 0
    elif pipelined and reshard == "step":
        gathers, scatters = 1, 1
    elif pipelined:
        gathers, scatters = 2 * micro, micro
    else:
        gathers, scatters = 2 * inner.grad_accum, 1
    per_node = cluster.gpus_per_node
    shard_inside = n <= per_node and per_node % n == 0  # consecutive ranks from a multiple of n: one node
    fsdp_bytes = stage_params * (n - 1) / n * (gathers * param_bytes + scatters * 4) if n > 1 else 0.0
    fsdp = fsdp_bytes / cluster.bandwidth(shard_inside)
    if r > 1:  # HSDP: the replicas all-reduce the shard's gradients
        replicas_inside = shape.dp <= per_node and per_node % shape.dp == 0
        fsdp += 2 * 4 * stage_params / n * (r - 1) / r / cluster.bandwidth(replicas_inside)
    sends = 0.0
    if pipelined:
        neighbours_inside = shape.world_size <= per_node  # else some stage boundary crosses nodes
        activation = micro_tokens * model.width * param_bytes
        sends = 2 * (shape.pp - 1) * activation / cluster.bandwidth(neighbours_inside)
    tokens = inner.batch_size * block * inner.grad_accum * shape.dp
    model_flops = (6 * (model.params - embedding) + layers * attention) * tokens
    seconds = max(compute, fsdp) + sends
    return StepEstimate(seconds, compute, fsdp, sends, bubble, tokens, model_flops, shard_inside)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _embeddings(model: ModelShape) -> set[str]:
    """The first stage's parameters before the blocks that are lookups, not matmuls (token and position
    embeddings): the built-in GPT's and Llama's names."""
    return {
        name
        for name, _ in model.stages[0]
        if name.endswith(("tok_emb.weight", "pos_emb.weight", "embed_tokens.weight"))
    }


@dataclass(frozen=True)
class RankedLayout:
    config: RunConfig
    plan: MemoryPlan
    step: StepEstimate


def candidate_layouts(config: RunConfig, gpus: int, layers: int) -> list[RunConfig]:
    """Every pp × dp (× dp_replicate) of `gpus` ranks the worker accepts, each stage at least one block;
    pipelined, every microbatch count of at least pp that divides the batch — more of them shrink the
    bubble and each one's activations, fewer keep the matmuls large — with one stage a rank (1F1B) or
    2, 4, 8 (the interleaved 1F1B) where the blocks allow."""
    out = []
    batch = config.inner.batch_size
    for pp in range(1, min(gpus, layers + 1) + 1):
        if gpus % pp:
            continue
        dp = gpus // pp
        micros = (
            [m for m in range(pp, batch + 1) if batch % m == 0] if pp > 1 else [config.parallel.microbatches]
        )  # ≥ pp: no idle stage
        # 1F1B (one stage a rank) and the interleaved 1F1B with 2, 4 or 8 stages a rank where the blocks allow
        schedules = (
            [("1f1b", 1)]
            + [("interleaved-1f1b", v) for v in (2, 4, 8) if pp > 1 and pp * v <= layers]
            + [("interleaved-zb", v) for v in (1, 2) if pp > 1 and pp * v <= layers]
        )
        for micro, (schedule, per_rank), replicate in itertools.product(
            micros, schedules, (r for r in range(1, dp + 1) if dp % r == 0)
        ):
            steps = micro * config.inner.grad_accum
            if per_rank > 1 and steps % interleaved_rounds(pp, steps)[0]:
                continue  # what torch's schedules refuse
            try:
                parallel = dataclasses.replace(
                    config.parallel,
                    pp=pp,
                    dp=dp,
                    dp_replicate=replicate,
                    microbatches=micro,
                    schedule=schedule,
                    stages_per_rank=per_rank,
                )
                out.append(dataclasses.replace(config, parallel=parallel))
            except ValueError:  # a layout the worker refuses
                continue
    return out


def shard_group_inside_node(config: RunConfig, cluster: Cluster) -> bool:
    """Whether each FSDP shard group lies inside one node (its ranks consecutive from a multiple of its
    size): FSDP re-gathers every block each step — each microbatch, resharding per microbatch — which
    NVLink carries and a node link does not. The search keeps to such layouts where any fits, as
    torchtitan recommends (HSDP's replicas and the pipeline cross nodes; their traffic is a fraction)."""
    n = config.parallel.dp_shard
    return n <= cluster.gpus_per_node and cluster.gpus_per_node % n == 0


def _cut(whole: ModelShape, config: RunConfig, shapes: dict[tuple[int, int], ModelShape]) -> ModelShape:
    key = (config.parallel.pp, config.parallel.stages_per_rank)
    shapes[key] = shapes.get(key) or whole.split(*key)
    return shapes[key]


def _fits(config: RunConfig, whole: ModelShape, shapes: dict, gpu_bytes: int | None, fused: bool) -> bool:
    return plan_memory(config, whole.vocab, gpu_bytes, fused, model=_cut(whole, config, shapes), quick=True).fits()


def rank_layouts(
    config: RunConfig,
    gpus: int,
    whole: ModelShape,
    gpu_bytes: int | None,
    cluster: Cluster,
    fused_attention: bool = True,
) -> list[RankedLayout]:
    """The layouts of `gpus` GPUs that fit, fastest (tokens per second) first. `whole`: the model's shape
    with one stage (`model_shape` at --pp 1), cut for each stage count without building it again."""
    shapes: dict[tuple[int, int], ModelShape] = {}
    ranked = []
    candidates = candidate_layouts(config, gpus, len(whole.blocks[0]))
    inside = [c for c in candidates if shard_group_inside_node(c, cluster)]
    for candidate in inside if any(_fits(c, whole, shapes, gpu_bytes, fused_attention) for c in inside) else candidates:
        cut = _cut(whole, candidate, shapes)
        plan = plan_memory(candidate, whole.vocab, gpu_bytes, fused_attention, model=cut, quick=True)
        if not plan.fits():
            continue
        resolved = dataclasses.replace(
            candidate, parallel=dataclasses.replace(candidate.parallel, pipeline_reshard=plan.pipeline_reshard)
        )
        ranked.append(RankedLayout(resolved, plan, estimate_step(resolved, cut, cluster, plan.pipeline_reshard)))
    return sorted(
        ranked,
        key=lambda r: (
            -r.step.tokens_per_s,
            r.config.parallel.pp,
            r.config.parallel.microbatches,
            r.config.parallel.dp_replicate,
        ),
    )
