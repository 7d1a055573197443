"""Hugging Face `transformers` causal LMs built from a configuration alone: no hub access, ever.

`AutoConfig.for_model(**config_json)` + `AutoModelForCausalLM.from_config` construct the architecture
locally and initialise it with the model's own `_init_weights` from torch's generator, which the
registry seeds with the run seed — so every cluster holds the same θ₀ without downloading anything.
`transformers` is an optional extra (`pip install 'dilocox[models]'`); the shards never import it.
"""

from __future__ import annotations

import torch
from torch import nn

from dilocox.common.logs import quiet_import_noise
from dilocox.worker.models.spec import ModelSpec, ModelSpecError

INSTALL_HINT = "pip install 'dilocox[models]'"


def _transformers():
    quiet_import_noise()  # transformers imports torchao where it is installed
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(f"Hugging Face models need the transformers package: {INSTALL_HINT}") from None
    transformers.logging.set_verbosity_error()  # no advice about hub downloads in a training log
    return transformers


def hf_config(spec: ModelSpec, block_size: int, vocab_size: int):
    """The `PretrainedConfig` a run trains: a preset takes the tokenizer's vocabulary; a user's
    config.json keeps its own, which must hold every token id the tokenizer produces."""
    transformers = _transformers()
    data = dict(spec.hf_config or {})
    if spec.from_preset:
        data["vocab_size"] = vocab_size
    data["use_cache"] = False  # training never reuses keys/values; a cache only costs memory
    try:
        config = transformers.AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as error:
        raise ModelSpecError(f"--model {spec.label}: not a usable Hugging Face configuration: {error}") from None
    if config.vocab_size < vocab_size:
        raise ModelSpecError(
            f"--model {spec.label}: its vocab_size {config.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({vocab_size} tokens): token ids would fall outside the embedding table"
        )
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and positions < block_size:
        raise ModelSpecError(f"--model {spec.label}: block size {block_size} exceeds its {positions} positions")
    return config


def build_hf_model(spec: ModelSpec, block_size: int, vocab_size: int) -> nn.Module:
    transformers = _transformers()
    config = hf_config(spec, block_size, vocab_size)
    auto = transformers.AutoModelForCausalLM
    try:
        try:  # PyTorch's fused attention where the architecture has it; its own default otherwise
            model = auto.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        except (ValueError, ImportError):
            model = auto.from_config(config, dtype=torch.float32)
    except ValueError as error:  # not a causal-LM architecture
        raise ModelSpecError(f"--model {spec.label}: {error}") from None
    return model


def ties_embeddings(model: nn.Module) -> bool:
    """True when the input embedding and the output head are one parameter (GPT-2's default)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None or get_in() is None or get_out() is None:
        return False
    return get_in().weight is get_out().weight
