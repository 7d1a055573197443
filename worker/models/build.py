"""Building the model `--model` names, identical on every cluster and in every layout.

θ₀ is defined per initialisation unit from the run's seed (worker/models/materialize.py): the model is
constructed with its parameters on the `meta` device (buffers computed as usual), and each unit's values
are drawn on the CPU from a generator seeded by the run seed and the unit's name. So one process
(`build_model`) and every rank of a sharded, pipelined site (`blueprint` + `materialize`) hold the same
bits, and no rank ever builds more than its shard plus one parameter. The vocabulary always comes from
the run's tokenizer.

A `module:function` model is the exception: its init is whatever its own code does, so it is built whole
on the CPU right after `torch.manual_seed(seed)`, as before, and trains as built.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.entry import build_entry_model
from dilocox.worker.models.gpt import GPT
from dilocox.worker.models.hf import build_hf_model
from dilocox.worker.models.materialize import InitFn, materialize, meta_skeleton, parameters_on_meta
from dilocox.worker.models.spec import ModelSpec, resolve_model
from dilocox.worker.models.weights import load_weights


@dataclasses.dataclass
class Blueprint:
    """A model before it has weights: `module` has its parameters on meta and its buffers computed;
    `skeleton` is a meta copy of the whole model (the reference every unit's init is drawn from, also for
    a pipeline stage cut out of `module`); `init_fn` the model's own per-module init. `built`: a
    `module:function` model, already whole with its own init (nothing to materialise)."""

    module: nn.Module
    skeleton: nn.Module
    init_fn: InitFn
    built: bool = False


def blueprint(config: ModelConfig, vocab_size: int, seed: int = 0) -> Blueprint:
    """The model's blueprint (`seed` only matters for a `module:function` model, built whole)."""
    spec = resolve_model(config.model)
    if spec.kind == "entry":
        with torch.device("cpu"):
            torch.manual_seed(seed)
            module = build_entry_model(spec.entry, config, vocab_size)
        return Blueprint(module, meta_skeleton(module), lambda m: None, built=True)
    with torch.device("cpu"), parameters_on_meta():
        module = _construct(spec, config, vocab_size)
    return Blueprint(module, meta_skeleton(module), module._init_weights)


def build_model(config: ModelConfig, vocab_size: int, seed: int) -> nn.Module:
    """The run's initial model in one process, on the CPU: the same bits every site and every layout
    starts from for this seed (or the `--weights` it continues from)."""
    plan = blueprint(config, vocab_size, seed)
    model = plan.module
    if not plan.built:
        materialize(model, "cpu", seed, plan.init_fn, plan.skeleton, fill=not config.weights)
    if config.weights:
        load_weights(model, config.weights)
    torch.manual_seed(seed)  # what draws next (dropout) starts from the seed, as in every layout
    return model


def meta_model(config: ModelConfig, vocab_size: int) -> nn.Module:
    """The model's structure on the meta device: names, shapes and modules, no memory and no init."""
    with torch.device("meta"):
        return _construct(resolve_model(config.model), config, vocab_size)


def model_param_specs(config: ModelConfig, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the whole model, built on the meta device: no memory."""
    return [(name, tuple(p.shape)) for name, p in meta_model(config, vocab_size).named_parameters()]


def largest_parameter(config: ModelConfig, vocab_size: int) -> int:
    """Elements of the model's largest parameter: what a rank holds whole, once, while materialising."""
    return max((math.prod(shape) for _, shape in model_param_specs(config, vocab_size)), default=0)


def _construct(spec: ModelSpec, config: ModelConfig, vocab_size: int) -> nn.Module:
    if spec.kind == "gpt":
        return GPT(dataclasses.replace(config, vocab_size=vocab_size))
    if spec.kind == "hf":
        return build_hf_model(spec, config.block_size, vocab_size)
    return build_entry_model(spec.entry, config, vocab_size)
