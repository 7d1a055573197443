"""Tests of the byte-level GPT in dilocox.worker.models.gpt."""

from __future__ import annotations

import math

import pytest
import torch

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.gpt import GPT

CFG = ModelConfig()


def _model(seed: int = 0, config: ModelConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def _batch(seed: int, b: int = 4, t: int = CFG.block_size) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (b, t), generator=g)


def test_structure_and_untied_head():
    m = _model()
    assert isinstance(m.tok_emb, torch.nn.Embedding) and m.tok_emb.weight.shape == (256, 128)
    assert m.pos_emb.weight.shape == (CFG.block_size, CFG.n_embd)
    assert len(m.blocks) == CFG.n_layer
    assert m.head.bias is None and m.head.weight.shape == (256, 128)
    assert m.head.weight.data_ptr() != m.tok_emb.weight.data_ptr()
    assert m.num_params() == sum(p.numel() for p in m.parameters())


def test_init_statistics():
    m = _model()
    assert m.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    resid_std = 0.02 / math.sqrt(2 * CFG.n_layer)
    assert m.blocks[0].mlp.proj.weight.std().item() == pytest.approx(resid_std, rel=0.1)
    assert m.blocks[0].attn.proj.weight.std().item() == pytest.approx(resid_std, rel=0.1)
    assert torch.all(m.blocks[0].mlp.fc.bias == 0)


def test_output_shapes_and_loss_none_without_targets():
    m = _model()
    idx = _batch(1, b=3, t=17)
    logits, loss = m(idx)
    assert logits.shape == (3, 17, CFG.vocab_size)
    assert loss is None
    _, loss = m(idx, idx)
    assert loss.dim() == 0


def test_loss_at_init_near_uniform():
    m = _model()
    idx = _batch(2)
    _, loss = m(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - math.log(256)) < 0.3


def test_too_long_sequence_rejected():
    m = _model()
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, CFG.block_size + 1, dtype=torch.long))


def test_causality():
    m = _model().eval()
    idx = _batch(3, b=2, t=32)
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        a, _ = m(idx)
        b, _ = m(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_same_seed_same_parameters_different_seed_differs():
    a, b, c = _model(7), _model(7), _model(8)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_pipeline_pieces_compose_to_forward():
    m = _model().eval()
    idx = _batch(4, b=2, t=40)
    with torch.no_grad():
        h = m.embed(idx)
        assert h.shape == (2, 40, CFG.n_embd)
        for block in m.blocks:
            h = block(h)
        piecewise = m.logits(h)
        full, _ = m(idx)
    torch.testing.assert_close(piecewise, full)


def test_adamw_overfits_one_batch():
    m = _model()
    idx = _batch(5, b=4, t=33)
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    _, first = m(x, y)
    for _ in range(25):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, last = m(x, y)
    assert last.item() < first.item() - 1.5
