"""The worker's size guard: refuse, before a torchrun job starts or a weight is made, a model that is
malformed, absurd (worker/models/bounds.py), or larger than this machine or its GPUs hold in the asked
layout — by the memory plan's numbers (worker/site/memory_plan.py), the ones `dilocox plan` prints."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig, RunConfig
from dilocox.worker.models.bounds import (
    MAX_PARAMS,
    available_host_bytes,
    check_fields,
    count_text,
    estimate_params,
    gb_text,
)
from dilocox.worker.models.spec import ModelSpecError, resolve_model
from dilocox.worker.site.memory_plan import EXCHANGE_BYTES_PER_PARAM, plan_memory, planned_precision


@dataclass(frozen=True)
class ModelSize:
    params: int
    build_bytes_per_process: int  # host memory to make a rank's shard: one whole parameter at a time
    train_bytes_per_rank: int  # the fullest rank's planned device bytes (weights … activations, reshard)

    def describe(self) -> str:
        return f"{count_text(self.params)} parameters"


def check_model_size(
    config: ModelConfig,
    vocab: int,
    parallel: ParallelConfig,
    local_processes: int = 1,
    device_bytes: int | None = None,
    host_bytes: int | None = None,
    inner: InnerConfig | None = None,
) -> ModelSize:
    """Refuse, with one line, a model that is malformed, absurd, or larger than this machine can build
    or train in the given layout; returns its size. The bytes are the memory plan's
    (worker/site/memory_plan.py, what `dilocox plan` prints): one model of memory for the guard and the
    plan. `local_processes`: ranks on this node; `device_bytes`: one GPU's memory (None on the CPU:
    training state is host memory then); `host_bytes`: memory available here (default: /proc/meminfo's
    MemAvailable); `inner`: the batch sizes the activations are planned for."""
    spec = resolve_model(config.model)
    sizes = check_fields(spec, config)
    estimate = estimate_params(sizes, vocab)
    if estimate > MAX_PARAMS:
        raise ModelSpecError(
            f"--model {spec.label}: about {count_text(estimate)} parameters, beyond the {count_text(MAX_PARAMS)} "
            "this project builds; check its sizes"
        )
    from dilocox.worker.models.build import model_param_specs

    try:
        params = sum(math.prod(shape) for _, shape in model_param_specs(config, vocab))
    except ModelSpecError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError) as error:
        raise ModelSpecError(f"--model {spec.label}: cannot be built from its configuration: {error}") from None
    if params > MAX_PARAMS:
        raise ModelSpecError(
            f"--model {spec.label}: {count_text(params)} parameters, beyond the {count_text(MAX_PARAMS)} this project "
            "builds"
        )
    run = planned_precision(
        RunConfig(model=config, parallel=parallel, inner=inner or InnerConfig()), on_gpu=bool(device_bytes)
    )
    plan = plan_memory(run, vocab, device_bytes, fused_attention=bool(device_bytes))
    worst = plan.peak_device
    size = ModelSize(params, max(r.host["build"] for r in plan.ranks), worst.device_need)
    host = available_host_bytes() if host_bytes is None else host_bytes
    per_process = max(r.host_peak for r in plan.ranks) + (0 if device_bytes else worst.device_total)
    need_host = local_processes * per_process
    if host is not None and need_host > host:
        lean = (
            ""
            if parallel.spill_dir and parallel.checkpoint_staging == "sync"
            else (
                "; --spill-dir (a local disk) and --checkpoint-staging sync keep 12 B per exchanged parameter, 16 at "
                "a checkpoint"
            )
        )
        raise ModelSpecError(
            f"--model {spec.label}: {size.describe()} need about {gb_text(need_host)} of host memory here "
            f"({local_processes} "
            f"process(es) on this node, each making its shard{'' if device_bytes else ', training it'} and keeping the "
            f"exchange's buffers; `dilocox plan` itemises it), and {gb_text(host)} is available{lean}"
        )
    if device_bytes and not plan.fits():
        raise ModelSpecError(
            f"--model {spec.label}: {size.describe()} need about {gb_text(worst.device_need)} per GPU at --pp "
            f"{parallel.pp} × "
            f"--dp {parallel.dp} (FSDP shards {parallel.dp_shard}), most of it {plan.binding()}, and a GPU here has "
            f"{gb_text(device_bytes)}: raise --pp or the FSDP shards (`dilocox plan --gpus N` lists the layouts that "
            "fit)"
        )
    return size


def check_exchange_host(
    owned_params: int,
    local_processes: int = 1,
    host_bytes: int | None = None,
    per_param: int = EXCHANGE_BYTES_PER_PARAM,
) -> int:
    """The public API's guard (its model is the caller's, built already): refuse, with one line, a rank
    whose exchange would not fit this machine's host memory — `per_param` per parameter it exchanges, the
    memory plan's figure (`exchange_bytes_per_param`) — before it joins the run. Returns the bytes planned
    per process."""
    need = per_param * owned_params
    host = available_host_bytes() if host_bytes is None else host_bytes
    if host is not None and local_processes * need > host:
        raise ModelSpecError(
            f"this rank exchanges {count_text(owned_params)} parameters: its host buffers, replica and momentum need "
            "about "
            f"{gb_text(need)} ({per_param} B each) × {local_processes} process(es) on this node, and "
            f"{gb_text(host)} is available; spread the model over more ranks (a SiteMesh with a larger dp or pp) "
            "or more nodes (`dilocox plan` itemises a layout)"
        )
    return need
