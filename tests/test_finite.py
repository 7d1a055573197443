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
