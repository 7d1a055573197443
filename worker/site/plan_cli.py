"""`dilocox plan MODEL --pp P --dp D …`: does this model fit this site? Per GPU, the bytes of each term
of worker/site/memory_plan.py; per rank, the host bytes of the exchange and a checkpoint; a verdict, and
with `--gpus N` the layouts of N GPUs that fit. `--measure` runs the layout on this machine's CPU (with
`--device cuda`: its GPUs) and prints planned against measured per rank (`--init-only`: stop after the shard is made)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

from dilocox.common.config.run import RunConfig, add_config_arguments, config_from_args
from dilocox.worker.site.memory_plan import GB, MemoryPlan, model_shape, plan_memory, planned_precision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_name", nargs="?", metavar="MODEL",
                        help="what --model takes: gpt, a preset (llama-1b, …), a config.json path (default: --model's)")  # fmt: skip
    parser.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB", help="memory of one GPU, GB (default 80)")
    parser.add_argument("--gpus", type=int, default=0, metavar="N", help="also list the layouts of N GPUs that fit")
    parser.add_argument("--measure", action="store_true",
                        help="run the layout's ranks on this machine (the CPU, gloo; with --device cuda its GPUs, NCCL) "
                             "and print planned vs measured per rank")  # fmt: skip
    parser.add_argument("--init-only", action="store_true", help="with --measure: stop after each rank has made its shard")
    add_config_arguments(parser)


def _vocab(config: RunConfig, given: int | None) -> int:
    """--vocab-size where given (the tokenizer's vocabulary), else the model's own: a config.json's
    vocab_size, the built-in GPT's bytes."""
    if given:
        return given
    from dilocox.worker.models.spec import resolve_model

    spec = resolve_model(config.model.model)
    return int((spec.hf_config or {}).get("vocab_size") or config.model.vocab_size)


def _gb(n: float) -> str:
    return f"{n / GB:.2f}" if n >= 0.1 * GB or n == 0 else f"{n / GB:.4f}"


def render(plan: MemoryPlan) -> str:
    s = plan.shape
    lines = [f"{plan.model}: {plan.params / 1e9:.3f}B parameters; --pp {s.pp} × --dp {s.dp} (dp_replicate {s.dp_replicate}, "
             f"FSDP shards {s.dp_shard}); {'bf16' if plan.bf16 else 'fp32'} compute"
             + (f"; --pipeline-reshard {plan.pipeline_reshard}" if s.pp > 1 and s.dp > 1 else "") + "; per GPU, GB:"]  # fmt: skip
    terms = list(plan.ranks[0].device)
    ranks = _distinct(plan)
    lines.append("rank stage " + " ".join(f"{t:>11}" for t in terms) + f" {'total':>9}")
    for r in ranks:
        lines.append(f"{r.rank:>4} {r.stage:>5} " + " ".join(f"{_gb(r.device[t]):>11}" for t in terms) + f" {_gb(r.device_total):>9}")
    start = "the start on disk (--spill-dir)" if plan.spilled else "the start in memory (--spill-dir: on disk, 4 B less)"
    staged = ("--checkpoint-staging async: the staging is kept from the first checkpoint on" if plan.checkpoint_staging == "async"
              else "--checkpoint-staging sync: nothing staged, the site waits for each write")  # fmt: skip
    lines.append(f"per rank, host GB ({start}; {staged}):")
    lines.append("rank stage  build (once)  exchange (steady)  + checkpoint (staged)   B/owned param steady / at checkpoint")
    for r in ranks:
        owned = max(1, r.owned)
        lines.append(f"{r.rank:>4} {r.stage:>5}  {_gb(r.host['build']):>11}  {_gb(r.host['exchange']):>17}  {_gb(r.host['checkpoint']):>20}"
                     f"   {r.host['exchange'] / owned:.1f} / {(r.host['exchange'] + r.host['checkpoint']) / owned:.1f}")  # fmt: skip
    if plan.gpu_bytes:
        worst = plan.peak_device
        verdict = "fits" if plan.fits() else "does NOT fit"
        lines.append(f"verdict: {verdict} on {plan.gpu_bytes / GB:.0f} GB GPUs: fullest rank {worst.rank} needs "
                     f"{_gb(worst.device_total)} GB; largest term {plan.binding()}")  # fmt: skip
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


def candidate_layouts(config: RunConfig, gpus: int) -> list[RunConfig]:
    """Every pp × dp (× dp_replicate) of `gpus` ranks the worker accepts, fewest stages first."""
    from dilocox.worker.models.bounds import check_fields
    from dilocox.worker.models.spec import resolve_model

    layers = check_fields(resolve_model(config.model.model), config.model).get("layers") or 1
    out = []
    for pp, replicate in itertools.product(range(1, gpus + 1), range(1, gpus + 1)):
        if gpus % pp or pp > layers + 1:
            continue
        dp = gpus // pp
        if dp % replicate:
            continue
        batch = config.inner.batch_size
        micro = next((m for m in range(max(config.parallel.microbatches, pp), batch + 1) if batch % m == 0), None) if pp > 1 \
            else config.parallel.microbatches  # fmt: skip
        if micro is None:
            continue
        try:
            parallel = dataclasses.replace(config.parallel, pp=pp, dp=dp, dp_replicate=replicate, microbatches=micro)
            out.append(dataclasses.replace(config, parallel=parallel))
        except ValueError:  # a layout the worker refuses
            continue
    return out


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
    plan = plan_memory(config, vocab, gpu_bytes, fused_attention=fused)
    print(render(plan))
    if args.gpus:
        print(f"layouts of {args.gpus} GPUs ({args.gpu_memory:.0f} GB each) that fit, fewest stages first:")
        fitting, shapes = 0, {}
        for candidate in candidate_layouts(config, args.gpus):
            pp = candidate.parallel.pp
            shapes[pp] = shapes.get(pp) or model_shape(candidate, vocab)  # one meta build per stage count
            p = plan_memory(candidate, vocab, gpu_bytes, fused_attention=fused, model=shapes[pp])
            if p.fits():
                fitting += 1
                c = candidate.parallel
                mode = f" --pipeline-reshard {p.pipeline_reshard}" if c.pp > 1 and c.dp > 1 else ""
                print(f"  --pp {c.pp} --dp {c.dp} --dp-replicate {c.dp_replicate} --microbatches {c.microbatches}{mode}: "
                      f"fullest GPU {_gb(p.peak_device.device_total)} GB (most: {p.binding()}), host {_gb(max(r.host_peak for r in p.ranks))} "
                      "GB per rank")  # fmt: skip
        if not fitting:
            print("  none: more GPUs, a shorter --block-size or a smaller --batch-size")
    if args.measure:
        from dilocox.worker.site.plan_measure import measure, measured_config, planned_init, planned_step

        config = measured_config(config)
        on_gpu = config.parallel.device.startswith("cuda")
        measured_plan = plan_memory(config, vocab, None, fused_attention=on_gpu)
        measured = measure(config, init_only=args.init_only)
        where = ("this machine's GPUs (NCCL), torch.cuda.max_memory_allocated" if on_gpu
                 else "this machine's CPU (gloo), resident set")  # fmt: skip
        print(f"measured on {where}, GB above each rank's baseline: planned / measured")
        for m in measured:
            row = f"  rank {m.rank}: init {_gb(planned_init(measured_plan, m.rank))} / {_gb(m.init)}"
            if m.step is not None:
                row += f"; steady step {_gb(planned_step(measured_plan, m.rank))} / {_gb(m.step)}"
            print(row)
    return 0 if plan.fits() else 1
