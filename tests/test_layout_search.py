"""`dilocox plan --gpus N` (worker/site/layout_search.py): the layouts that fit, ranked by an estimated step
that knows nodes, from one shape of the model cut for every stage count — and a Llama-shaped config.json's
parameters without transformers (worker/models/decoder_shapes.py), equal to the built model's."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from unittest import mock

import pytest

from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig, RunConfig
from dilocox.worker.site import model_shape as shapes
from dilocox.worker.site.layout_search import Cluster, estimate_step, rank_layouts, shard_group_inside_node
from dilocox.worker.site.memory_plan import GB, plan_memory
from dilocox.worker.site.model_shape import model_shape

VOCAB = 128256


def run_config(model: str, state: str = "int8") -> RunConfig:
    return RunConfig(
        model=ModelConfig(model=model, block_size=4096),
        inner=InnerConfig(batch_size=8),
        parallel=ParallelConfig(precision="bf16", activation_checkpoint="full", device="cuda", optimizer_state=state),
    )


@pytest.mark.parametrize("model", ["llama-tiny", "llama-20m", "llama-1b", "dense-107b", "qwen2"])
def test_a_llama_shaped_config_gives_the_built_models_parameters_without_building_it(model, tmp_path):
    pytest.importorskip("transformers")
    if model == "qwen2":
        config = {
            "model_type": "qwen2",
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        }
        (tmp_path / "config.json").write_text(json.dumps(config))
        model = str(tmp_path / "config.json")
        (tmp_path / "tied.json").write_text(json.dumps({**config, "model_type": "llama", "tie_word_embeddings": True}))
        assert (
            shapes._decoder_shape(ModelConfig(model=str(tmp_path / "tied.json")), 512) is None
        )  # built: --pp > 1 refused
    mc = ModelConfig(model=model, block_size=64)
    fast = shapes._decoder_shape(mc, 512)
    assert fast is not None
    shapes._model_shape.cache_clear()
    with mock.patch.object(shapes, "_decoder_shape", lambda *_: None):  # the meta build, as for any other model
        for pp in (1, 2, 3):
            built = shapes._model_shape(mc, 512, pp)
            cut = fast if pp == 1 else fast.split(pp)
            assert cut.stages == built.stages and cut.blocks == built.blocks
            assert (cut.width, cut.mlp, cut.heads, cut.gated) == (built.width, built.mlp, built.heads, built.gated)
    shapes._model_shape.cache_clear()


def test_a_whole_models_shape_cuts_into_stages_as_split_model_does():
    """ModelShape.split against the stages `split_model` cuts from the meta model, one stage a rank and
    several (each rank's stages r, r + pp, … together, as RankStages names them)."""
    from dilocox.worker.models.build import meta_model
    from dilocox.worker.train.pipeline_stage import RankStages, rank_stages, split_model

    for model in ("gpt", "llama-tiny"):
        config = ModelConfig(model=model, n_layer=6)
        whole = model_shape(RunConfig(model=config), 256)
        meta = meta_model(config, 256)
        layers = len(whole.blocks[0])
        for pp, per_rank in [(p, v) for p, v in ((2, 1), (3, 1), (2, 2), (2, 3)) if p * v <= layers]:
            cut = whole.split(pp, per_rank)
            for rank in range(pp):
                built = RankStages([split_model(meta, s, pp * per_rank) for s in rank_stages(rank, pp, per_rank)])
                assert cut.stages[rank] == [(n, tuple(p.shape)) for n, p in built.named_parameters()], (
                    model,
                    pp,
                    per_rank,
                )
                assert sum(cut.blocks[rank]) == sum(
                    p.numel() for n, p in built.named_parameters() if ".layers." in n or "blocks." in n
                )


def test_the_bubble_and_the_links_follow_the_layout():
    cluster = Cluster(gpus_per_node=8)
    whole = model_shape(run_config("llama-3-70b"), VOCAB)

    def layout(pp: int, dp: int, replicate: int = 1, micro: int = 8, reshard: str = "microbatch"):  # noqa: ANN202
        config = run_config("llama-3-70b")
        config = dataclasses.replace(
            config,
            parallel=dataclasses.replace(config.parallel, pp=pp, dp=dp, dp_replicate=replicate, microbatches=micro),
        )
        return estimate_step(config, whole.split(pp), cluster, reshard), config

    two, config = layout(2, 8)
    assert two.bubble == pytest.approx(1 / 9) and shard_group_inside_node(config, cluster) and two.fsdp_inside_node
    assert layout(8, 2)[0].bubble == pytest.approx(7 / 15)  # the 47 % of the old 70B layout
    assert layout(2, 8, micro=4)[0].bubble == pytest.approx(1 / 5)
    across, config = layout(1, 16)  # 16-way FSDP over two nodes: the node link, 7 × slower than NVLink here
    assert not across.fsdp_inside_node and not shard_group_inside_node(config, cluster)
    hsdp, _ = layout(1, 16, replicate=2)  # two replicas of 8-way shards: FSDP inside each node
    assert hsdp.fsdp_inside_node and hsdp.fsdp_s < across.fsdp_s
    assert layout(2, 8, reshard="step")[0].fsdp_s < two.fsdp_s  # one gather and one reduce a step, not per microbatch
    assert two.tokens == 8 * 4096 * 8 and 0.15 < two.mfu(16, cluster) < cluster.mfu


def test_a_16_gpu_site_trains_llama_3_70b_and_a_32_gpu_site_the_107b_with_8_bit_moments():
    """With int8 moments the 70B fits 16 × 80 GB and the 107B 32 with FSDP
    inside each node; with fp32 moments neither fits, with bf16 only by sharding across nodes. The search keeps FSDP
    inside a node, ranks by tokens per second, and
    its quick plans are never below the full plan of the layout it lists."""
    cluster = Cluster()
    for model, gpus in (("llama-3-70b", 16), ("dense-107b", 32)):
        whole = model_shape(run_config(model), VOCAB)
        assert not rank_layouts(run_config(model, "fp32"), gpus, whole, int(80 * GB), cluster)
        bf16 = rank_layouts(
            run_config(model, "bf16"), gpus, whole, int(80 * GB), cluster
        )  # the 107B: FSDP across nodes only
        assert not any(shard_group_inside_node(r.config, cluster) for r in bf16)
        ranked = rank_layouts(run_config(model), gpus, whole, int(80 * GB), cluster)
        assert ranked and all(shard_group_inside_node(r.config, cluster) for r in ranked)
        speeds = [r.step.tokens_per_s for r in ranked]
        assert speeds == sorted(speeds, reverse=True)
        best = ranked[0]
        full = plan_memory(best.config, VOCAB, int(80 * GB))
        assert full.fits() and best.plan.margin <= full.margin and best.plan.margin > 0
    best70 = rank_layouts(
        run_config("llama-3-70b"), 16, model_shape(run_config("llama-3-70b"), VOCAB), int(80 * GB), cluster
    )[0]
    assert (best70.config.parallel.pp, best70.config.parallel.dp) == (2, 8)


def test_dilocox_plan_lists_the_fastest_layouts_and_the_first_rank_by_rank():
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "plan",
        "llama-3-70b",
        "--gpus",
        "16",
        "--gpus-per-node",
        "8",
        "--gpu-memory",
        "80",
        "--optimizer-state",
        "int8",
        "--block-size",
        "4096",
        "--inner-batch-size",
        "8",
        "--activation-checkpoint",
        "full",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "layouts of 16 GPUs (80 GB each, 2 node(s) of 8" in out and "--pp 2 --dp 8" in out
    for said in (
        "margin",
        "bubble 11%",
        "tokens/s",
        "MFU",
        "FSDP over NVLink",
        "the fastest, rank by rank",
        "verdict: fits",
    ):
        assert said in out, out
    none = subprocess.run(
        [*cmd[:-8], "--optimizer-state", "fp32", "--block-size", "4096", "--inner-batch-size", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        none.returncode == 1 and "none: more GPUs, --optimizer-state int8, --activation-checkpoint full" in none.stdout
    )
