"""The round's update by blocks (`aggregation.apply_round`, `OuterNesterov.step_by_block`) against the
whole-tensor arithmetic it replaces: the same bits, on slices spanning several blocks, for the first
step, later steps, in place and not; and fp32 payloads decoded without a copy."""

from __future__ import annotations

import ctypes

import pytest
import torch

from dilocox.common.wire.aggregation import apply_round, weighted_mean
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.common.wire.outer_optimizer import BLOCK_ELEMENTS, OuterNesterov

LR, MU = 0.7, 0.9


def whole_tensor_step(
    param: torch.Tensor, buf: torch.Tensor | None, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outer Nesterov step as whole-tensor operations, one rounding each (the pre-block form)."""
    buf = grad.clone() if buf is None else (buf * MU).add_(grad)
    return param - (buf * MU).add_(grad).mul_(LR), buf


def contributions(n: int, seed: int, weights=(3000.0, 1000.0, 2500.0)):
    g = torch.Generator().manual_seed(seed)
    drawn = [torch.randn(n, generator=g) for _ in weights]
    return [(f"c{i}", w, (lambda t=t: t)) for i, (w, t) in enumerate(zip(weights, drawn))]


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("together", [False, True])
def test_blocked_round_update_has_the_bits_of_the_whole_tensor_form(in_place, together):
    n = 5 * (BLOCK_ELEMENTS // 2)  # two and a half blocks
    g = torch.Generator().manual_seed(1)
    param = torch.randn(n, generator=g).reshape(-1, 5)
    outer = OuterNesterov(LR, MU)
    want_param, want_buf = param.clone(), None
    for round_ in range(3):  # the first step starts the momentum; the later ones use it
        items = [(c, w, (lambda d=d: d().reshape(-1, 5))) for c, w, d in contributions(n, 10 + round_)]
        grad = weighted_mean(items)
        want_param, want_buf = whole_tensor_step(want_param, want_buf, grad)
        before, before_buf = param.clone(), None if round_ == 0 else outer.buffers["k"].clone()
        old_buf = outer.buffers.get("k")
        got = apply_round(reversed(items), outer, "k", param, in_place=in_place, decode_together=together)
        assert torch.equal(got, want_param) and torch.equal(outer.buffers["k"], want_buf)
        if in_place:
            assert got is param and (old_buf is None or outer.buffers["k"].data_ptr() == old_buf.data_ptr())
        else:  # a published version keeps its tensors: neither may change
            assert torch.equal(param, before) and (old_buf is None or torch.equal(old_buf, before_buf))
        param = got


def test_a_non_contiguous_parameter_is_stepped_into_a_new_tensor():
    outer = OuterNesterov(LR, MU)
    base = torch.randn(64, 32)
    param = base.t()  # not contiguous: a flat view would be a copy
    grad = torch.randn(32, 64)
    got = outer.step("k", param, grad, in_place=True)
    want, _ = whole_tensor_step(param, None, grad)
    assert torch.equal(got, want) and torch.equal(param, base.t())


def test_apply_round_refuses_contributions_of_the_wrong_size_and_skips_empty_slices():
    outer = OuterNesterov(LR, MU)
    with pytest.raises(ValueError, match="elements"):
        apply_round([("a", 1.0, lambda: torch.ones(9))], outer, "k", torch.zeros(10))
    assert apply_round([], outer, "k", torch.zeros(10)) is None
    assert "k" not in outer.buffers


def test_a_bytearray_fp32_payload_decodes_to_a_view_of_its_bytes():
    key = SliceKey("w", 0, 4)
    item = EncodedSlice.exact(key, torch.arange(12, dtype=torch.float32).reshape(4, 3))
    assert isinstance(item.payload, bytearray)
    decoded = item.decode()
    start = ctypes.addressof(ctypes.c_char.from_buffer(item.payload))
    assert decoded.data_ptr() == start and len(item.payload) == decoded.numel() * 4
    assert torch.equal(decoded, torch.arange(12, dtype=torch.float32).reshape(4, 3))
    copied = EncodedSlice(key, item.codec, item.dtype, item.shape, bytes(item.payload)).decode()
    assert copied.data_ptr() != start and torch.equal(copied, decoded)
