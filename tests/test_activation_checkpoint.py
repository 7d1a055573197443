"""`--activation-checkpoint full` recomputes each block's forward in its backward (`selective`: every other
block's): the same training, bit for bit, with the parameter names the shards see unchanged."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig, RunConfig
from dilocox.worker.data.corpus import load_corpus
from dilocox.worker.models.build import build_model
from dilocox.worker.train.inner_trainer import InnerTrainer


@pytest.mark.parametrize("model", ["gpt", "llama-tiny"])
def test_checkpointed_blocks_train_the_same_bits_under_the_same_names(model):
    base = RunConfig(
        model=ModelConfig(model=model, block_size=32),
        inner=InnerConfig(batch_size=4, steps=2),
        parallel=ParallelConfig(device="cpu", precision="fp32"),
    )
    runs = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        config = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, activation_checkpoint=mode))
        trainer = InnerTrainer(config, load_corpus(None))
        losses = [trainer.train_steps(1)[0] for _ in range(2)]
        runs[mode] = (losses, {n: p.detach().clone() for n, p in trainer.named_parameters()})
    plain_losses, plain = runs["none"]
    for mode in ("selective", "full"):
        ckpt_losses, ckpt = runs[mode]
        assert ckpt_losses == plain_losses, mode
        assert ckpt.keys() == plain.keys() and not any("checkpoint" in n for n in ckpt)
        assert all(torch.equal(ckpt[n], plain[n]) for n in plain), mode


def test_selective_checkpoints_every_other_block_from_the_first():
    from dilocox.worker.site.parallelize import checkpoint_blocks, transformer_blocks

    model = build_model(ModelConfig(n_layer=5, n_embd=32, n_head=4), 256, 0)
    assert checkpoint_blocks(model, "selective") == 3
    wrapped = [isinstance(b.forward, functools.partial) for b in transformer_blocks(model)]
    assert wrapped == [True, False, True, False, True]


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="activation_checkpoint must be none, selective or full"):
        ParallelConfig(activation_checkpoint="every-third")
