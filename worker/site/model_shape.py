"""What the memory plan and the layout search need of a model, without making it: every parameter's name
and shape by pipeline rank, each rank's blocks and stages, and the model's sizes.

One shape of the whole model is made per process and model — from a Llama-family config.json directly
(worker/models/decoder_shapes.py, no transformers) or from the model built on the meta device — and cut for
any stage count as `split_model` cuts it (`ModelShape.split`, held equal to a build of every stage in
tests/test_layout_search.py), so that `dilocox plan --gpus N` weighs dozens of layouts in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from dilocox.common.config.run import ModelConfig, ParallelConfig, RunConfig

Specs = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class ModelShape:
    """Every parameter's (name, shape) by pipeline rank, and the model's sizes."""

    stages: list[Specs]  # per pipeline rank (its stages together), in order
    blocks: list[list[int]]  # per pipeline rank, the element count of each transformer block
    width: int
    mlp: int
    heads: int
    vocab: int
    gated: bool = False  # a gated MLP (Llama's gate_proj/up_proj): four hidden tensors per token, not two
    # Of a whole model (one stage): each parameter's block, -1 before the blocks (embeddings: the first
    # stage's) and len(blocks) after them (final norm, head: the last stage's) — what `split` cuts by.
    layer_of: tuple[int, ...] = ()
    # Per pipeline rank, the number of blocks in each of its stages (`--stages-per-rank`; one stage: all).
    chunk_layers: tuple[tuple[int, ...], ...] = ()
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # the plan's sums by rank, kept

    @property
    def params(self) -> int:
        if "params" not in self.memo:
            self.memo["params"] = sum(math.prod(shape) for stage in self.stages for _, shape in stage)
        return self.memo["params"]

    def layers_of_chunks(self, rank_stage: int) -> tuple[int, ...]:
        return self.chunk_layers[rank_stage] if self.chunk_layers else (len(self.blocks[rank_stage]),)

    def split(self, pp: int, stages_per_rank: int = 1) -> ModelShape:
        """This whole model's shape cut into pp · v stages as `split_model` cuts it (`stage_layers`), rank r
        holding stages r, r + pp, … (`rank_stages`), from the one shape: the layout search plans every
        stage count without building the model again."""
        from dilocox.worker.train.pipeline_stage import rank_stages, stage_layers

        if len(self.stages) != 1 or len(self.layer_of) != len(self.stages[0]):
            raise ValueError("ModelShape.split: needs the shape of a whole model (model_shape with --pp 1)")
        layers, virtual = len(self.blocks[0]), pp * stages_per_rank
        stage_of_layer = {layer: stage for stage in range(virtual) for layer in stage_layers(layers, stage, virtual)}
        stage_of_layer.update({-1: 0, layers: virtual - 1})
        parts: list[Specs] = [[] for _ in range(virtual)]
        for spec, layer in zip(self.stages[0], self.layer_of):
            parts[stage_of_layer[layer]].append(spec)
        mine = [rank_stages(r, pp, stages_per_rank) for r in range(pp)]
        stages = [[spec for s in owned for spec in parts[s]] for owned in mine]
        blocks = [
            [self.blocks[0][layer] for s in owned for layer in stage_layers(layers, s, virtual)] for owned in mine
        ]
        chunks = tuple(tuple(len(stage_layers(layers, s, virtual)) for s in owned) for owned in mine)
        return dataclasses.replace(self, stages=stages, blocks=blocks, layer_of=(), chunk_layers=chunks, memo={})


def model_shape(config: RunConfig, vocab: int) -> ModelShape:
    """The model's shape for `config`'s pipeline (no memory); made once per model, vocabulary and stage
    count in a process (`dilocox plan` asks for the same one several times)."""
    return _model_shape(config.model, vocab, config.parallel.pp, config.parallel.stages_per_rank)


@functools.lru_cache(maxsize=16)
def _model_shape(model_config: ModelConfig, vocab: int, pp: int, stages_per_rank: int = 1) -> ModelShape:
    whole = _decoder_shape(model_config, vocab)  # a Llama-shaped config.json: no transformers, no build
    if whole is None:
        whole = _built_shape(model_config, vocab)
        if pp > 1:  # refuse what split_model refuses (another architecture, tied embeddings), by name
            from dilocox.worker.train.pipeline_stage import check_splittable

            check_splittable(model_config, pp * stages_per_rank)
    return whole if pp == 1 else whole.split(pp, stages_per_rank)


def _built_shape(model_config: ModelConfig, vocab: int) -> ModelShape:
    """The whole model's shape from its meta structure."""
    from dilocox.worker.models.bounds import check_fields
    from dilocox.worker.models.build import meta_model
    from dilocox.worker.models.spec import resolve_model
    from dilocox.worker.site.parallelize import transformer_blocks

    config = RunConfig(model=model_config, parallel=ParallelConfig())
    model = meta_model(model_config, vocab)
    sizes = check_fields(resolve_model(model_config.model), model_config)
    specs = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    in_block = {id(p): i for i, block in enumerate(transformer_blocks(model)) for p in block.parameters()}
    blocks = [sum(p.numel() for p in block.parameters()) for block in transformer_blocks(model)]
    seen_block, layer_of = False, []
    for _, p in model.named_parameters():
        layer = in_block.get(id(p))
        seen_block |= layer is not None
        layer_of.append(layer if layer is not None else (len(blocks) if seen_block else -1))
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None) or config.model.n_head
    width = sizes.get("width") or config.model.n_embd
    gated = any(name.endswith("gate_proj.weight") for name, _ in specs)
    return ModelShape(
        [specs], [blocks], width, sizes.get("mlp") or 4 * width, int(heads), vocab, gated, tuple(layer_of)
    )


def _decoder_shape(model_config: ModelConfig, vocab: int) -> ModelShape | None:
    """The whole model's shape from its config.json where worker/models/decoder_shapes.py knows the family."""
    from dilocox.worker.models.decoder_shapes import decoder_param_specs
    from dilocox.worker.models.spec import resolve_model

    spec = resolve_model(model_config.model)
    if spec.kind != "hf" or not spec.hf_config:
        return None
    config = spec.hf_config
    if config.get("tie_word_embeddings"):  # one parameter on two stages: the build refuses --pp > 1 by name
        return None
    specs = decoder_param_specs(config, vocab if spec.from_preset else int(config.get("vocab_size") or vocab))
    if specs is None:
        return None
    layers = int(config["num_hidden_layers"])
    layer_of = tuple(
        int(n.split(".")[2])
        if n.startswith("model.layers.")
        else (-1 if n.startswith("model.embed_tokens") else layers)
        for n, _ in specs
    )
    blocks = [0] * layers
    for (_, shape), layer in zip(specs, layer_of):
        if 0 <= layer < layers:
            blocks[layer] += math.prod(shape)
    return ModelShape(
        [specs],
        [blocks],
        int(config["hidden_size"]),
        int(config["intermediate_size"]),
        int(config["num_attention_heads"]),
        vocab,
        gated=True,
        layer_of=layer_of,
    )
