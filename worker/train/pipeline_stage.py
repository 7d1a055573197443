"""Pipeline stages: a contiguous run of blocks, with the embeddings first and the head last.

Parameter names are kept exactly as in the full model (`blocks.3.attn.qkv.weight`, `head.weight` for the
built-in GPT; `model.layers.3.self_attn.q_proj.weight`, `lm_head.weight` for a Llama), so the shard
assignment, the model digest and the pseudo-gradient slices are the same whether a cluster runs one
process or a pipeline: a stage simply owns a subset of the names.

Two families split: the built-in GPT, and Hugging Face decoder-only models laid out like Llama
(`model.embed_tokens`, `model.layers`, `model.rotary_emb`, `model.norm`, `lm_head`: Llama, Mistral,
Qwen2, …). Anything else is refused with its name; a model whose head shares the embedding's weight
is refused too, since the two would live on different stages.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.build import blueprint, meta_model
from dilocox.worker.models.gpt import GPT
from dilocox.worker.models.hf import ties_embeddings
from dilocox.worker.models.materialize import materialize
from dilocox.worker.models.weights import load_weights


class PipelineSplitError(ValueError):
    """A model that `--pp` cannot cut into stages."""


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
        self.config: ModelConfig = model.config
        self.hidden_size = self.config.n_embd
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        if self.is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        # A ModuleDict keyed by the block's index keeps the full model's parameter names.
        self.blocks = nn.ModuleDict(
            {str(i): model.blocks[i] for i in stage_layers(self.config.n_layer, stage, num_stages)}
        )
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


LLAMA_LAYOUT = ("model.embed_tokens", "model.layers", "model.rotary_emb", "model.norm", "lm_head")


def _has_llama_layout(model: nn.Module) -> bool:
    def has(path: str) -> bool:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return False
        return True

    return all(has(path) for path in LLAMA_LAYOUT)


class DecoderStage(nn.Module):
    """A stage of a Llama-family Hugging Face model: its decoder layers, the token embedding on the
    first stage, the final norm and the head on the last. Every stage recomputes the rotary position
    embedding and the causal mask from the hidden states' shape (they hold no parameters)."""

    def __init__(self, lm: nn.Module, stage: int, num_stages: int) -> None:
        super().__init__()
        self.hf_config = lm.config
        self.hidden_size = lm.config.hidden_size
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.model = nn.Module()  # keeps the full model's names: model.embed_tokens, model.layers.<i>, ...
        if self.is_first:
            self.model.embed_tokens = lm.model.embed_tokens
        indices = stage_layers(len(lm.model.layers), stage, num_stages)
        self.model.layers = nn.ModuleDict({str(i): lm.model.layers[i] for i in indices})
        self.model.rotary_emb = lm.model.rotary_emb
        if self.is_last:
            self.model.norm = lm.model.norm
            self.lm_head = lm.lm_head
        from transformers.masking_utils import create_causal_mask

        self._create_causal_mask = create_causal_mask
        self._mask_cache_kwarg = (
            "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(x) if self.is_first else x
        positions = torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)
        mask = self._create_causal_mask(
            config=self.hf_config,
            inputs_embeds=hidden,
            attention_mask=None,
            position_ids=positions,
            **{self._mask_cache_kwarg: None},
        )
        rotary = self.model.rotary_emb(hidden, position_ids=positions)
        for layer in self.model.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                hidden = hidden[0]
        if self.is_last:
            hidden = self.lm_head(self.model.norm(hidden))
        return hidden


def split_model(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Stage `stage` of `model`, or PipelineSplitError naming the architecture and why."""
    if isinstance(model, GPT):
        return GPTStage(model, stage, num_stages)
    name = type(model).__name__
    if not _has_llama_layout(model):
        raise PipelineSplitError(
            f"--pp {num_stages}: cannot split {name} into pipeline stages; --pp > 1 supports the built-in GPT and "
            f"Llama-family Hugging Face models ({', '.join(LLAMA_LAYOUT)}). Train it with --pp 1."
        )
    if num_stages > 1 and ties_embeddings(model):
        raise PipelineSplitError(
            f"--pp {num_stages}: {name} ties its output head to its input embedding (tie_word_embeddings=true), "
            'and the two would live on different stages. Set "tie_word_embeddings": false in its config.json '
            "(the head then trains on its own), or use --pp 1."
        )
    return DecoderStage(model, stage, num_stages)


def rank_stages(rank_stage: int, pp: int, stages_per_rank: int) -> list[int]:
    """The virtual stages of pipeline rank `rank_stage` when each rank holds `stages_per_rank` of the
    pp · v: rank r holds r, r + pp, r + 2·pp, … (the "looped" placement torch's interleaved schedules use),
    so the model's first stage and its last sit on the first and the last rank as with one stage each."""
    return [rank_stage + k * pp for k in range(stages_per_rank)]


class RankStages(nn.Module):
    """A pipeline rank's stages together (`--stages-per-rank` > 1), under the whole model's parameter names.

    torch's interleaved schedules drive each stage on its own (`chunks`, one PipelineStage each, each its
    own FSDP root); everything that works by name — the exchange, DCP checkpoints, weights, the memory plan
    — sees one module whose tree is the union of the stages' trees: `blocks.3` and `blocks.11` side by side,
    the embedding where stage 0 is, the head where the last is. The same module objects, not copies."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.__dict__["chunks"] = list(chunks)  # not submodules: their names would prefix every parameter's
        for chunk in chunks:
            _merge_into(self, chunk)

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise RuntimeError("RankStages is not called: its pipeline schedule runs each of its stages (chunks)")

    def train(self, mode: bool = True) -> RankStages:
        super().train(mode)
        for chunk in self.chunks:  # the stages' own roots are not in this tree
            chunk.train(mode)
        return self


def stage_modules(module: nn.Module) -> list[nn.Module]:
    """The stages a rank computes: a RankStages' chunks, or the module itself."""
    return list(module.chunks) if isinstance(module, RankStages) else [module]


def _merge_into(target: nn.Module, source: nn.Module) -> None:
    """Add `source`'s children to `target` by name: one `target` lacks is added as it is (a container —
    a ModuleDict of blocks, a plain `nn.Module` holding others — as a fresh one merged into, so that later
    stages can join it); the same object twice (a rotary embedding every stage computes) is kept once."""
    for name, child in source.named_children():
        mine = target._modules.get(name)
        if mine is child:
            continue
        if mine is None and not _is_container(child):
            target.add_module(name, child)
        elif mine is None or (_is_container(mine) and _is_container(child)):
            if mine is None:
                mine = nn.ModuleDict() if isinstance(child, nn.ModuleDict) else nn.Module()
                target.add_module(name, mine)
            _merge_into(mine, child)
        else:
            raise ValueError(f"RankStages: two stages both hold {name!r}, as different modules")


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, nn.ModuleDict) or type(module) is nn.Module


def build_stage(config: ModelConfig, vocab_size: int, seed: int, stage: int, num_stages: int) -> nn.Module:
    """The stage of the model every cluster builds from `seed`, on the CPU, bit-identical to the same
    parameters of the single-process model: cut from the model's meta blueprint, then only the stage's
    parameters are made (worker/models/materialize.py)."""
    plan = blueprint(config, vocab_size, seed)
    module = split_model(plan.module, stage, num_stages)
    if not plan.built:
        materialize(module, "cpu", seed, plan.init_fn, plan.skeleton, fill=not config.weights)
    if config.weights:
        load_weights(module, config.weights)
    return module


def check_splittable(config: ModelConfig, num_stages: int) -> None:
    """Refuse (PipelineSplitError) a model `--pp num_stages` cannot split, from its structure on the meta
    device: before any weights are made or a torchrun job is started for it."""
    if num_stages > 1:
        split_model(meta_model(config, vocab_size=1), 0, num_stages)
