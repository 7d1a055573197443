"""Building the model `--model` names, identical on every cluster.

Every cluster of a run builds the same θ₀: the model is constructed right after `torch.manual_seed(seed)`
from the run's configuration alone, on the CPU (a device's random generator would differ), and moved to
the trainer's device afterwards. The vocabulary always comes from the run's tokenizer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.entry import build_entry_model
from dilocox.worker.models.gpt import GPT
from dilocox.worker.models.hf import build_hf_model
from dilocox.worker.models.spec import ModelSpec, resolve_model
from dilocox.worker.models.weights import load_weights


def build_model(config: ModelConfig, vocab_size: int, seed: int) -> nn.Module:
    """The run's initial model, identical on every cluster for the same seed (built on the CPU)."""
    spec = resolve_model(config.model)
    with torch.device("cpu"):
        torch.manual_seed(seed)
        model = _construct(spec, config, vocab_size)
    if config.weights:
        load_weights(model, config.weights)
    return model


def meta_model(config: ModelConfig, vocab_size: int) -> nn.Module:
    """The model's structure on the meta device: names, shapes and modules, no memory and no init."""
    with torch.device("meta"):
        return _construct(resolve_model(config.model), config, vocab_size)


def model_param_specs(config: ModelConfig, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the whole model, built on the meta device: no memory."""
    return [(name, tuple(p.shape)) for name, p in meta_model(config, vocab_size).named_parameters()]


def _construct(spec: ModelSpec, config: ModelConfig, vocab_size: int) -> nn.Module:
    if spec.kind == "gpt":
        return GPT(dataclasses.replace(config, vocab_size=vocab_size))
    if spec.kind == "hf":
        return build_hf_model(spec, config.block_size, vocab_size)
    return build_entry_model(spec.entry, config, vocab_size)
