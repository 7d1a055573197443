"""The one-pass finiteness check every decoded payload goes through."""

from __future__ import annotations

import math

import pytest
import torch

from dilocox.common.wire.finite import all_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_bad_value_anywhere_is_found(bad):
    t = torch.randn(1000)
    for index in (0, 517, 999):
        u = t.clone()
        u[index] = bad
        assert not all_finite(u)
    assert all_finite(t)


def test_edge_cases():
    assert all_finite(torch.empty(0))
    assert all_finite(torch.tensor(3.0))
    assert all_finite(torch.full((4,), torch.finfo(torch.float32).max))  # large but finite
    assert all_finite(torch.arange(5))  # integers are always finite
    assert not all_finite(torch.tensor([1.0, float("nan")], dtype=torch.float64))


def test_lowrank_payloads_are_vetted_without_decoding_and_refused_as_decode_would():
    """`codecs.vet` checks a low-rank payload on its factors: finite, and a bound on |P Qᵀ| far below
    fp32's range — so what it lets through decodes finite, and what would overflow is refused."""
    from dilocox.common.wire import codecs
    from dilocox.common.wire.errors import InvalidFrame
    from dilocox.common.wire.lowrank import encode_lowrank

    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(64, 4, generator=g), torch.randn(32, 4, generator=g)
    good = bytearray(encode_lowrank(p, q, factor_bits=32))
    codecs.vet("lowrank", good, "float32", (64, 32))
    assert all_finite(codecs.decode("lowrank", good, "float32", (64, 32)))
    huge = bytearray(encode_lowrank(p * 1e19, q * 1e19, factor_bits=32))  # finite factors, product ~1e38+
    for payload, match in (
        (huge, "overflow"),
        (bytearray(encode_lowrank(p.index_fill(0, torch.tensor([3]), float("nan")), q, factor_bits=32)), "NaN"),
    ):
        with pytest.raises(InvalidFrame, match=match):
            codecs.vet("lowrank", payload, "float32", (64, 32))
    with pytest.raises(InvalidFrame):  # the decode refuses the overflowing one too
        codecs.decode("lowrank", huge, "float32", (64, 32))
    with pytest.raises(InvalidFrame, match="frame shape"):
        codecs.vet("lowrank", good, "float32", (32, 64))


def test_every_kind_of_float32_bit_pattern_at_every_position():
    """Each class of fp32 bit pattern, both signs, at the start, middle and end of tensors of several
    lengths: finite (max normal, subnormals, ±0) passes; ±Inf and NaNs (quiet, signalling, sign bit
    set) are found wherever they are."""
    patterns = [
        0x00000000,
        0x80000000,
        0x00000001,
        0x807FFFFF,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x3F800000,  # finite
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFFFFFFFF,
    ]
    for n in (1, 7, 8, 33, 1000):
        base = torch.randn(n)
        for pattern in patterns:
            for index in sorted({0, n // 2, n - 1}):
                t = base.clone()
                t.view(torch.int32)[index] = torch.tensor(pattern, dtype=torch.int64).to(torch.int32)
                assert all_finite(t) == all(math.isfinite(x) for x in t.tolist()), (hex(pattern), n, index)


def test_a_vetted_payload_is_decoded_without_the_second_pass_and_anything_else_with_it():
    """A shard vets each pushed slice as it arrives and marks it vetted: its close decodes views without
    reading them for NaN again. A slice not marked (read from a checkpoint, built locally) is checked."""
    from dilocox.common.wire import codecs
    from dilocox.common.wire.errors import InvalidFrame
    from dilocox.common.wire.framing import EncodedSlice, SliceKey

    key = SliceKey("w", 0, 2)
    payload = bytearray(torch.tensor([[1.0, float("nan")], [2.0, 3.0]]).numpy().tobytes())
    with pytest.raises(InvalidFrame, match="NaN"):
        codecs.vet("fp32", payload, "float32", (2, 2))
    with pytest.raises(InvalidFrame, match="NaN"):
        EncodedSlice(key, "fp32", "float32", (2, 2), payload).decode_lazy()
    # Marked vetted, the check is not run (which is why only the assembler's vetted buffers are marked).
    assert torch.isnan(EncodedSlice(key, "fp32", "float32", (2, 2), payload, vetted=True).decode_lazy()).any()
    assert EncodedSlice(key, "fp32", "float32", (2, 2), payload, vetted=True) == EncodedSlice(
        key, "fp32", "float32", (2, 2), payload
    )
