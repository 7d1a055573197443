"""The one-pass finiteness check every decoded payload goes through."""

from __future__ import annotations

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
    for payload, match in ((huge, "overflow"), (bytearray(encode_lowrank(p.index_fill(0, torch.tensor([3]), float("nan")), q, factor_bits=32)), "NaN")):
        with pytest.raises(InvalidFrame, match=match):
            codecs.vet("lowrank", payload, "float32", (64, 32))
    with pytest.raises(InvalidFrame):  # the decode refuses the overflowing one too
        codecs.decode("lowrank", huge, "float32", (64, 32))
    with pytest.raises(InvalidFrame, match="frame shape"):
        codecs.vet("lowrank", good, "float32", (32, 64))
