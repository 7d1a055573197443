"""One pipeline stage of the GPT: a contiguous run of blocks, with the embeddings first and the head last.

Parameter names are kept exactly as in the full `GPT` (`blocks.3.attn.qkv.weight`, `head.weight`), so
the shard assignment, the model digest and the pseudo-gradient slices are the same whether a cluster
runs one process or a pipeline: a stage simply owns a subset of the names.
"""

from __future__ import annotations

import torch
from torch import nn

from dilocox.common.config.run import GPTConfig
from dilocox.worker.models.gpt import GPT


def stage_layers(n_layer: int, stage: int, num_stages: int) -> range:
    """Blocks of `stage`: an even split, earlier stages taking the remainder."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside [0, {num_stages})")
    if num_stages > n_layer + 1:
        raise ValueError(f"{num_stages} stages for {n_layer} blocks leaves a stage empty; use pp ≤ n_layer + 1")
    bounds = [n_layer * i // num_stages for i in range(num_stages + 1)]
    return range(bounds[stage], bounds[stage + 1])


class GPTStage(nn.Module):
    """Stage `stage` of `num_stages`: first → token ids in, last → logits out, else hidden → hidden."""

    def __init__(self, model: GPT, stage: int, num_stages: int) -> None:
        super().__init__()
        self.config: GPTConfig = model.config
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        # A ModuleDict keyed by the block's index keeps the full model's parameter names.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in stage_layers(self.config.n_layer, stage, num_stages)})
        if self.is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.head(self.ln_f(x))
        return x


def build_stage(config: GPTConfig, seed: int, stage: int, num_stages: int) -> GPTStage:
    """The stage of the model every cluster builds from `seed`, identical to the single-process init.

    The full model is built once (so the initialisation is bit-identical to `GPT` under the same seed),
    the stage keeps its own modules, and the rest is dropped before training starts.
    """
    torch.manual_seed(seed)
    return GPTStage(GPT(config), stage, num_stages)


def full_param_specs(config: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the whole model, built on the meta device: no memory."""
    with torch.device("meta"):
        model = GPT(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]
