"""`dilocox plan MODEL --pp P --dp D …`: does this model fit this site? Per GPU, the bytes of each term
of worker/site/memory_plan.py; per rank, the host bytes of the exchange and a checkpoint; a verdict, and
with `--gpus N` the layouts of N GPUs that fit. `--measure` runs the layout on this machine's CPU (with
`--device cuda`: its GPUs) and prints planned against measured per rank (`--init-only`: stop after the shard is
made)."""

from __future__ import annotations

import argparse
import dataclasses

from dilocox.common.config.run import RunConfig
from dilocox.common.config.run_flags import add_config_arguments, config_from_args
from dilocox.worker.site.layout_search import H100_BF16_TFLOPS, Cluster, RankedLayout, rank_layouts
from dilocox.worker.site.memory_plan import GB, MemoryPlan, plan_memory, planned_precision
from dilocox.worker.site.model_shape import model_shape

TERMS = """the terms, per GPU (worker/site/memory_plan.py; on the CPU the same bytes are host memory):
  weights, grads   FSDP2's sharded fp32 parameters and their gradients: 4 + 4 B per element a rank holds
  optimizer        AdamW's two moments: 8 B (fp32), 4 (--optimizer-state bf16) or ~2 (int8)
  gathered         parameters FSDP2 has all-gathered to compute (the whole stage with --pipeline-reshard step)
  grad_accum       gradient accumulators: unsharded fp32 gradients before FSDP's reduce-scatter
  activations      what autograd keeps per token and block, times the microbatches in flight
  logits           the last stage's logits and the loss's transients
  pp_buffers       torch's pipeline receive buffers, one per microbatch and stage boundary
  reshard          the round boundary's buffers between FSDP's layout and the exchange's
  opt_step         AdamW's transient at its step (none for fused fp32 on a GPU)
  cuda+nccl        beside the tensors, on a GPU: the CUDA context and NCCL's buffers (3 GB)
  fragment         the caching allocator's fragmentation, 3 % with expandable_segments
per rank, host: build (one whole parameter while it is made), exchange (16 B per owned parameter, 12 with
--spill-dir), checkpoint (the staged copy with --checkpoint-staging async)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = TERMS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "model_name",
        nargs="?",
        metavar="MODEL",
        help="what --model takes: gpt, a preset (llama-1b, …), a config.json path (default: --model's)",
    )
    parser.add_argument(
        "--gpu-memory", type=float, default=80.0, metavar="GB", help="memory of one GPU, GB (default 80)"
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=0,
        metavar="N",
        help="also list the layouts of N GPUs that fit, fastest first by an estimated step time",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        metavar="G",
        help="with --gpus: GPUs a node holds, joined by NVLink (default 8); torchrun places consecutive ranks on "
        "a node",
    )
    parser.add_argument(
        "--node-link-gbit",
        type=float,
        default=400.0,
        metavar="GBIT",
        help="with --gpus: each GPU's link to other nodes, Gbit/s (default 400: a 400G NIC per GPU)",
    )
    parser.add_argument(
        "--gpu-tflops",
        type=float,
        default=H100_BF16_TFLOPS,
        metavar="T",
        help=f"with --gpus: one GPU's dense bf16 peak, TFLOP/s (default {H100_BF16_TFLOPS:g}: H100/H200)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=0.4,
        metavar="F",
        help="with --gpus: the share of that peak the matmuls reach, for the estimate (default 0.4)",
    )
    parser.add_argument(
        "--top", type=int, default=5, metavar="K", help="with --gpus: how many layouts to list (default 5)"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="run the layout's ranks on this machine (the CPU, gloo; with --device cuda its GPUs, NCCL) "
        "and print planned vs measured per rank",
    )
    parser.add_argument(
        "--init-only", action="store_true", help="with --measure: stop after each rank has made its shard"
    )
    add_config_arguments(parser)


def _vocab(config: RunConfig, given: int | None) -> int:
    """--vocab-size where given (the tokenizer's vocabulary), else the model's own: a config.json's
    vocab_size, the built-in GPT's bytes."""
    if given:
        return given
    from dilocox.worker.models.spec import resolve_model

    spec = resolve_model(config.model.model)
    return int((spec.hf_config or {}).get("vocab_size") or config.model.vocab_size)


# Column headers of the terms whose names are wider than a column (memory_plan.py's names).
HEADERS = {
    "grad_accumulators": "grad_accum",
    "pipeline_buffers": "pp_buffers",
    "optimizer_step": "opt_step",
    "cuda_context": "cuda+nccl",
    "fragmentation": "fragment",
}


def _gb(n: float) -> str:
    return f"{n / GB:.2f}" if n >= 0.1 * GB or n == 0 else f"{n / GB:.4f}"


def render(plan: MemoryPlan) -> str:
    s = plan.shape
    lines = [
        f"{plan.model}: {plan.params / 1e9:.3f}B parameters; --pp {s.pp} × --dp {s.dp} (dp_replicate {s.dp_replicate}, "
        f"FSDP shards {s.dp_shard}); {'bf16' if plan.bf16 else 'fp32'} compute"
        + (f"; --pipeline-reshard {plan.pipeline_reshard}" if s.pp > 1 and s.dp > 1 else "")
        + "; per GPU, GB:"
    ]
    terms = list(plan.ranks[0].device)
    extra = list(plan.ranks[0].overheads)
    ranks = _distinct(plan)
    lines.append("rank stage " + " ".join(f"{HEADERS.get(t, t):>11}" for t in terms + extra) + f" {'total':>9}")
    for r in ranks:
        cells = [r.device[t] for t in terms] + [r.overheads[t] for t in extra]
        lines.append(
            f"{r.rank:>4} {r.stage:>5} " + " ".join(f"{_gb(c):>11}" for c in cells) + f" {_gb(r.device_need):>9}"
        )
    start = (
        "the start on disk (--spill-dir)" if plan.spilled else "the start in memory (--spill-dir: on disk, 4 B less)"
    )
    staged = (
        "--checkpoint-staging async: the staging is kept from the first checkpoint on"
        if plan.checkpoint_staging == "async"
        else "--checkpoint-staging sync: nothing staged, the site waits for each write"
    )
    lines.append(f"per rank, host GB ({start}; {staged}):")
    lines.append(
        "rank stage  build (once)  exchange (steady)  + checkpoint (staged)   B/owned param steady / at checkpoint"
    )
    for r in ranks:
        owned = max(1, r.owned)
        lines.append(
            f"{r.rank:>4} {r.stage:>5}  {_gb(r.host['build']):>11}  {_gb(r.host['exchange']):>17}  "
            f"{_gb(r.host['checkpoint']):>20}"
            f"   {r.host['exchange'] / owned:.1f} / {(r.host['exchange'] + r.host['checkpoint']) / owned:.1f}"
        )
    lines.append(
        f"a site checkpoint: {_gb(plan.checkpoint_bytes)} GB on a disk every rank sees; with --checkpoint-keep 2 and "
        "the next "
        f"one being written, {_gb(plan.checkpoint_disk(2))} GB"
    )
    if plan.gpu_bytes:
        worst = plan.peak_device
        verdict = "fits" if plan.fits() else "does NOT fit"
        beside = (
            f" ({_gb(worst.device_total)} of tensors + {_gb(sum(worst.overheads.values()))} beside them)"
            if worst.overheads
            else ""
        )
        lines.append(
            f"verdict: {verdict} on {plan.gpu_bytes / GB:.0f} GB GPUs: fullest rank {worst.rank} needs "
            f"{_gb(worst.device_need)} GB{beside}, margin {_gb(plan.margin)} GB; largest term {plan.binding()}"
        )
    return "\n".join(lines)


def _distinct(plan: MemoryPlan) -> list:
    """Every rank where there are few; the fullest rank of each stage otherwise."""
    if len(plan.ranks) <= 16:
        return plan.ranks
    by_stage: dict[int, object] = {}
    for r in plan.ranks:
        if r.stage not in by_stage or r.device_total > by_stage[r.stage].device_total:
            by_stage[r.stage] = r
    return list(by_stage.values())


def _flags(config: RunConfig) -> str:
    c = config.parallel
    mode = f" --pipeline-reshard {c.pipeline_reshard}" if c.pp > 1 and c.dp > 1 and c.pipeline_reshard != "auto" else ""
    schedule = f" --schedule {c.schedule} --stages-per-rank {c.stages_per_rank}" if c.stages_per_rank > 1 else ""
    return f"--pp {c.pp} --dp {c.dp} --dp-replicate {c.dp_replicate} --microbatches {c.microbatches}{schedule}{mode}"


def render_layouts(
    config: RunConfig, args: argparse.Namespace, vocab: int, gpu_bytes: int | None, fused: bool
) -> tuple[str, list[RankedLayout]]:
    """The `--gpus` listing: the fastest layouts that fit, each with its memory, margin and estimate."""
    cluster = Cluster(args.gpus_per_node, args.node_link_gbit, args.gpu_tflops, args.mfu)
    whole = model_shape(
        dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, pp=1, dp=1, dp_replicate=1)), vocab
    )
    ranked = rank_layouts(config, args.gpus, whole, gpu_bytes, cluster, fused_attention=fused)
    nodes = -(-args.gpus // args.gpus_per_node)
    lines = [
        f"layouts of {args.gpus} GPUs ({args.gpu_memory:.0f} GB each, {nodes} node(s) of {args.gpus_per_node}, "
        f"{args.node_link_gbit:g} Gbit/s per GPU between nodes) that fit: {len(ranked)}; the fastest by an estimate at "
        f"{args.mfu:.0%} of {args.gpu_tflops:g} TFLOP/s (worker/site/layout_search.py):"
    ]
    for r in ranked[: max(1, args.top)]:
        c, p, e = r.config.parallel, r.plan, r.step
        fsdp = "" if c.dp == 1 else f", FSDP over {'NVLink' if e.fsdp_inside_node else 'the node link'}"
        lines.append(
            f"  {_flags(r.config)}: fullest GPU "
            f"{_gb(p.peak_device.device_need)} GB, margin {_gb(p.margin)} GB; host "
            f"{_gb(max(x.host_peak for x in p.ranks))} GB a "
            f"rank; step ≈ {e.seconds:.2f} s (compute {e.compute_s:.2f}, bubble {e.bubble:.0%}; FSDP "
            f"{e.fsdp_s:.2f}{fsdp}; "
            f"sends {e.sends_s:.2f}), {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu(args.gpus, cluster):.0%}"
        )
    if not ranked:
        levers = (
            ["more GPUs"]
            + (["--optimizer-state int8"] if config.parallel.optimizer_state != "int8" else [])
            + (["--activation-checkpoint full"] if config.parallel.activation_checkpoint != "full" else [])
            + ["a shorter --block-size", "a smaller --inner-batch-size"]
        )
        lines.append("  none: " + ", ".join(levers))
    return "\n".join(lines), ranked


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        if args.model_name:
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=args.model_name))
    except (ValueError, TypeError) as error:  # a layout or setting the worker would refuse: said as it would
        raise SystemExit(f"dilocox plan: bad configuration: {error}") from None
    config = planned_precision(config, on_gpu=config.parallel.device != "cpu")
    from dilocox.worker.models.spec import ModelSpecError

    try:
        vocab = _vocab(config, getattr(args, "vocab_size", None))
    except ModelSpecError as error:
        raise SystemExit(f"dilocox plan: {error}") from None
    gpu_bytes = int(args.gpu_memory * GB) if args.gpu_memory else None
    fused = config.parallel.device != "cpu" and not (args.measure and not config.parallel.device.startswith("cuda"))
    layout_given = (
        args.parallel__pp is not None or args.parallel__dp is not None or args.parallel__dp_replicate is not None
    )
    ranked = []
    if layout_given or not args.gpus:  # the layout asked for, first
        plan = plan_memory(config, vocab, gpu_bytes, fused_attention=fused)
        print(render(plan))
    if args.gpus:
        text, ranked = render_layouts(config, args, vocab, gpu_bytes, fused)
        print(text)
    if args.gpus and not layout_given:  # the fastest layout's own table, in full, rather than one GPU's
        if ranked:
            config = ranked[0].config
            print(f"the fastest, rank by rank ({_flags(config)}):")
        plan = plan_memory(config, vocab, gpu_bytes, fused_attention=fused)
        print(render(plan))
    if args.measure:
        from dilocox.worker.site.plan_measure import measure, measured_config, planned_init, planned_step

        config = measured_config(config)
        on_gpu = config.parallel.device.startswith("cuda")
        measured_plan = plan_memory(config, vocab, None, fused_attention=on_gpu)
        measured = measure(config, init_only=args.init_only)
        where = (
            "this machine's GPUs (NCCL), torch.cuda.max_memory_allocated"
            if on_gpu
            else "this machine's CPU (gloo), resident set"
        )
        print(f"measured on {where}, GB above each rank's baseline: planned / measured")
        for m in measured:
            row = f"  rank {m.rank}: init {_gb(planned_init(measured_plan, m.rank))} / {_gb(m.init)}"
            if m.step is not None:
                row += f"; steady step {_gb(planned_step(measured_plan, m.rank))} / {_gb(m.step)}"
            print(row)
    return 0 if plan.fits() or (ranked and not layout_given) else 1
