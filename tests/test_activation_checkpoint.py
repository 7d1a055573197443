"""`--activation-checkpoint full` recomputes each block's forward in its backward: the same training,
bit for bit, with the parameter names the shards see unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig, RunConfig
from dilocox.worker.data.corpus import load_corpus
from dilocox.worker.train.inner_trainer import InnerTrainer


@pytest.mark.parametrize("model", ["gpt", "llama-tiny"])
def test_checkpointed_blocks_train_the_same_bits_under_the_same_names(model):
    base = RunConfig(
        model=ModelConfig(model=model, block_size=32),
        inner=InnerConfig(batch_size=4, steps=2),
        parallel=ParallelConfig(device="cpu", precision="fp32"),
    )
    runs = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        config = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, activation_checkpoint=mode))
        trainer = InnerTrainer(config, load_corpus(None))
        losses = [trainer.train_steps(1)[0] for _ in range(2)]
        runs[mode] = (losses, {n: p.detach().clone() for n, p in trainer.named_parameters()})
    (plain_losses, plain), (ckpt_losses, ckpt) = runs["none"], runs["full"]
    assert ckpt_losses == plain_losses
    assert ckpt.keys() == plain.keys() and not any("checkpoint" in n for n in ckpt)
    assert all(torch.equal(ckpt[n], plain[n]) for n in plain)


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="activation_checkpoint must be none or full"):
        ParallelConfig(activation_checkpoint="selective")
