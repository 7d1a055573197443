"""The refused part of a push is kept once per push and delivered with the slices' next push."""

from __future__ import annotations

import torch

from dilocox.worker.exchange.carry import UndeliveredCarry


def test_a_refused_push_is_kept_once_and_added_to_the_next_push_of_its_slices():
    carry = UndeliveredCarry()
    a, b = torch.ones(3), torch.full((2,), 2.0)
    assert carry.keep(1, {"a": a}) == ["a"]
    assert carry.keep(1, {"a": a}) == []  # the same push refused again (a re-push): not kept twice
    out = carry.add_to({"a": torch.zeros(3), "b": b})
    assert torch.equal(out["a"], a) and out["b"] is b
    assert list(carry.pending_keys()) == []  # delivered: no longer pending
    assert carry.elements == 3


def test_a_new_push_that_is_refused_again_keeps_what_it_carried():
    """Refused twice in a row (a shard behind for two rounds): the second push held the first's part."""
    carry = UndeliveredCarry()
    carry.keep(1, {"a": torch.ones(2)})
    second = carry.add_to({"a": torch.full((2,), 10.0)})  # what push 2 sends: its own Δ plus push 1's part
    carry.keep(2, {"a": second["a"]})  # refused as well
    third = carry.add_to({"a": torch.zeros(2)})
    assert torch.equal(third["a"], torch.full((2,), 11.0))  # nothing lost, nothing twice


def test_other_slices_stay_pending_until_pushed():
    carry = UndeliveredCarry()
    carry.keep(1, {"a": torch.ones(2), "b": torch.ones(2)})
    carry.add_to({"a": torch.zeros(2)})
    assert list(carry.pending_keys()) == ["b"]


def test_a_kept_part_is_weighted_by_its_own_tokens_in_the_next_push():
    """Pushed with 10 tokens, refused, then added to a push of 40: scaled by 10/40, so that the shard's
    mean (Σ w·Δ / Σ w) gets 10·Δ for it, as on time; with equal weights it is added unscaled."""
    carry = UndeliveredCarry()
    late = torch.tensor([4.0, 8.0])
    carry.keep(1, {"a": late}, weight=10.0)
    pushed = carry.add_to({"a": torch.ones(2)}, weight=40.0)
    assert torch.equal(pushed["a"], torch.ones(2) + late * (10.0 / 40.0))
    assert torch.equal(40.0 * (pushed["a"] - 1), 10.0 * late)
    carry.keep(2, {"a": late}, weight=40.0)
    assert torch.equal(carry.add_to({"a": torch.ones(2)}, weight=40.0)["a"], torch.ones(2) + late)
