"""A model a team brings as code: `--model package.module:function`.

The function is called as `function(model_config, vocab_size)` (a `ModelConfig` and the tokenizer's
vocabulary size) right after the run seed is set, and returns an `nn.Module` whose `forward(idx)` takes
token ids [batch, time] and returns logits [batch, time, vocab] (worker/models/contract.py). Parameter
names are what the shards see, so every cluster must import the same code. Pipeline parallelism needs
a split the project knows, so such a model trains with `--pp 1`.
"""

from __future__ import annotations

import importlib

from torch import nn

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.spec import ModelSpecError


def build_entry_model(entry: str, config: ModelConfig, vocab_size: int) -> nn.Module:
    module_name, _, function_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelSpecError(f"--model {entry}: cannot import {module_name}: {error}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ModelSpecError(f"--model {entry}: {module_name} has no function {function_name}")
    model = function(config, vocab_size)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"--model {entry}: {function_name} returned {type(model).__name__}, not an nn.Module")
    if not any(True for _ in model.parameters()):
        raise ModelSpecError(f"--model {entry}: the module it returned has no parameters")
    return model
