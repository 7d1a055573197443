"""The forward contract of every model a cluster trains, and the loss the trainers compute from it.

A model is an `nn.Module` whose `forward(idx)` takes token ids, a LongTensor [batch, time], and returns
the next-token logits [batch, time, vocab] — as a tensor, as the first element of a tuple (the built-in
GPT returns `(logits, loss)`), or as an object with `.logits` (Hugging Face's `CausalLMOutput`). The
trainers compute the cross-entropy themselves, so a model needs no loss code and no label convention
(Hugging Face's `labels` shift inside the model; ours are shifted by the data loader).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dilocox.worker.models.chunked_loss import chunked_cross_entropy


class ModelContractError(TypeError):
    """A model's forward returned something that holds no logits."""


def logits_of(output: object) -> torch.Tensor:
    """The logits in whatever a model's forward returned (tensor, tuple/list, or `.logits`)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ModelContractError(
        f"the model's forward returned {type(output).__name__}; expected logits [batch, time, vocab] as a tensor, "
        "a tuple starting with them, or an object with .logits"
    )


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats), computed in fp32 whatever precision the logits are in: fp32
    logits in one call, as always; bf16 (or fp16) logits a piece at a time, so the microbatch's logits
    never exist in fp32 (worker/models/chunked_loss.py; the same gradient bit for bit)."""
    if logits.dim() != 3 or logits.shape[:2] != targets.shape:
        raise ModelContractError(
            f"logits of shape {tuple(logits.shape)} do not match targets of shape {tuple(targets.shape)} "
            "(expected [batch, time, vocab])"
        )
    if logits.dtype != torch.float32:
        return chunked_cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def lm_loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(logits_of(model(idx)), targets)
