"""Stale work is weighed by its age: the sites' discount, the shards' cap, and the
clients' replay of a capped round staying bit-exact."""

from __future__ import annotations

import pytest
import torch

from dilocox.common.wire.aggregation import weighted_mean
from dilocox.common.wire.errors import InvalidFrame
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.common.wire.staleness import cap_claimed_weights, cap_stale_weights, stale_discount
from dilocox.server.rounds.round_state import RoundAccumulator
from dilocox.worker.exchange.carry import UndeliveredCarry
from dilocox.worker.exchange.cluster import slice_tensors
from tests.test_uneven_sites import LR, MOMENTUM, RUN, _started, _tensors


def test_the_discount_falls_with_age_and_full_keeps_the_tokens():
    assert [stale_discount(a) for a in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert stale_discount(3, "full") == 1.0
    with pytest.raises(ValueError):
        stale_discount(-1)
    with pytest.raises(ValueError):
        stale_discount(1, "halve")


def test_a_stale_contribution_never_outweighs_the_on_time_ones():
    """The incident's numbers: 21,504 tokens from a start three rounds old against 1,024 on time had 95 %
    of the round; capped at the on-time mean they have at most half."""
    assert cap_stale_weights({"on-time": 1024.0, "late": 21504.0}, {"late": 3}) == {"on-time": 1024.0, "late": 1024.0}
    assert cap_stale_weights({"a": 10.0, "b": 30.0, "late": 5.0}, {"late": 1}) == {"a": 10.0, "b": 30.0, "late": 5.0}
    assert cap_stale_weights({"a": 10.0, "b": 30.0, "late": 50.0}, {"late": 1})["late"] == 20.0
    assert cap_stale_weights({"late": 50.0}, {"late": 2}) == {"late": 50.0}  # nobody on time: nothing to be fair to
    assert cap_stale_weights({"a": 7.0, "b": 9.0}, {}) == {"a": 7.0, "b": 9.0}


def test_a_carried_part_is_discounted_by_its_age_and_never_weighs_more_than_its_push():
    late = torch.tensor([4.0, 8.0])
    carry = UndeliveredCarry()
    carry.keep(1, {"a": late}, weight=10.0, trained=2)
    pushed = carry.add_to(
        {"a": torch.zeros(2)}, weight=40.0, round_=3
    )  # one round late: × 1/2, its own 10 of 40 tokens
    assert torch.equal(pushed["a"], late * (0.5 * 10.0 / 40.0))
    carry.keep(2, {"a": late}, weight=80.0, trained=2)
    pushed = carry.add_to({"a": torch.zeros(2)}, weight=40.0, round_=4)  # two rounds late, 80 tokens riding on 40
    assert torch.equal(pushed["a"], late * (1 / 3))
    full = UndeliveredCarry("full")
    full.keep(1, {"a": late}, weight=80.0, trained=2)
    assert torch.equal(
        full.add_to({"a": torch.zeros(2)}, weight=40.0, round_=4)["a"], late * 2.0
    )  # as on time: w_g / w


def _slice(value: float) -> EncodedSlice:
    return EncodedSlice.exact(SliceKey("w", 0, 2), torch.full((2, 3), value))


def test_the_sealed_round_steps_on_the_capped_weights_and_checks_each_cluster_says_one_staleness():
    acc = RoundAccumulator(5)
    acc.check_weight("a", 10.0)
    acc.add("a", 10.0, _slice(1.0))
    acc.check_weight("late", 90.0, staleness=2)
    acc.add("late", 90.0, _slice(3.0), staleness=2)
    with pytest.raises(InvalidFrame, match="staleness"):
        acc.check_weight("late", 90.0, staleness=1)
    with pytest.raises(InvalidFrame, match="≥ 0"):
        acc.check_weight("b", 1.0, staleness=-1)
    assert acc.weigh(claim_multiple=0) == {"late": (2, 90.0, 90.0, 10.0)}
    weights = {c: x.weight for c, x in acc.contributions[SliceKey("w", 0, 2)].items()}
    assert weights == {"a": 10.0, "late": 10.0}  # what the step uses and the shard forwards
    assert acc.cluster_weights == {"a": 10.0, "late": 90.0}  # the tokens as said (status, metrics)
    mean = weighted_mean(
        [(c, w, (lambda v=v: torch.full((2, 3), v))) for c, w, v in (("a", 10.0, 1.0), ("late", 10.0, 3.0))]
    )
    assert torch.equal(mean, torch.full((2, 3), 2.0))


def test_tokens_are_a_claim_capped_at_a_multiple_of_the_other_sites_median():
    """Leave-one-out: a site claiming 1000× weighs 4× the others' median; honest uneven sites (a site 3× the
    others) keep their tokens; two sites cap each other; one site, or multiple 0, as said."""
    said = {"a": 100.0, "b": 110.0, "c": 90.0, "liar": 100_000.0}
    assert cap_claimed_weights(said, 4.0) == {"a": 100.0, "b": 110.0, "c": 90.0, "liar": 400.0}
    uneven = {"a": 100.0, "b": 100.0, "big": 300.0}
    assert cap_claimed_weights(uneven, 4.0) == uneven
    assert cap_claimed_weights({"a": 100.0, "liar": 1e6}, 4.0) == {"a": 100.0, "liar": 400.0}
    assert cap_claimed_weights({"a": 1e6}, 4.0) == {"a": 1e6} and cap_claimed_weights(said, 0) == said
    acc = RoundAccumulator(3)
    for cluster, tokens in said.items():
        acc.check_weight(cluster, tokens)
        acc.add(cluster, tokens, _slice(1.0))
    assert acc.weigh(4.0) == {"liar": (0, 100_000.0, 400.0, 400.0)}
    assert acc.used_weights()["liar"] == 400.0 and acc.cluster_weights["liar"] == 100_000.0  # used vs said


def test_a_caught_up_push_is_capped_by_the_shards_and_every_replica_replays_it_bit_for_bit(shard_set):
    """Over gRPC: a site pushes work two rounds older than the round with 9× the tokens; each shard weighs
    it at the on-time site's tokens, forwards that weight, and both clients' replicas equal the shards'."""
    shards = shard_set(2, RUN, min_clusters=2, outer_lr=LR, outer_momentum=MOMENTUM)
    a, late = _started(shards.addresses, ("a", "late"))
    try:
        a.push(1, 10.0, slice_tensors(a.assignment, _tensors(11)))
        late.push(1, 90.0, slice_tensors(late.assignment, _tensors(12)), facts=(84, 0.0, 2))
        shards.wait_version(1)
        for client in (a, late):
            client.pull(min_version=1)
        for shard in shards.shards:
            assert dict(shard.last_round.tokens) == {"a": 10.0, "late": 90.0}
            assert {c: x.weight for per_key in shard.snapshot.contributions.values() for c, x in per_key.items()} == {
                "a": 10.0,
                "late": 10.0,
            }
            for key, tensor in shard.snapshot.tensors.items():
                assert torch.equal(a.held[key], tensor) and torch.equal(late.held[key], tensor), key
    finally:
        a.close()
        late.close()


def test_the_lenient_rule_forgives_one_round_and_discounts_older_work():
    assert [stale_discount(a, "lenient") for a in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]


def test_work_declared_fresher_than_the_version_it_was_trained_from_is_weighed_by_its_least_age(shard_set):
    """An age is a claim too: a site that pulled nothing after version 2 and pushes rounds 4 and 5
    saying its work is on time (staleness 0) trained it from version 2 at the newest — at least 1 and 2
    rounds old. Each shard weighs it by that age (tokens × 1/(1 + age)), records the age it used, says so,
    and forwards the weight: the honest site's replica replays it bit for bit. Honest late work declared at
    its age, and on-time work, are untouched."""
    import structlog

    shards = shard_set(2, RUN, min_clusters=2, outer_lr=LR, outer_momentum=MOMENTUM)
    a, liar = _started(shards.addresses, ("a", "liar"))
    try:
        for r in (1, 2, 3):
            a.push(r, 10.0, slice_tensors(a.assignment, _tensors(10 * r)))
            liar.push(r, 10.0, slice_tensors(liar.assignment, _tensors(10 * r + 1)))
            a.pull(min_version=r)
            if r < 3:
                liar.pull(min_version=r)  # ... and then no more: it holds version 2
            for shard in shards.shards:
                assert {c: x.weight for per in shard.snapshot.contributions.values() for c, x in per.items()} == {
                    "a": 10.0,
                    "liar": 10.0,
                }
        with structlog.testing.capture_logs() as logs:
            for r, least in ((4, 1), (5, 2)):
                a.push(r, 10.0, slice_tensors(a.assignment, _tensors(10 * r)))
                liar.push(r, 10.0, slice_tensors(liar.assignment, _tensors(10 * r + 1)))  # "on time"
                a.pull(min_version=r)
                for shard in shards.shards:
                    used = {c: x.weight for per in shard.snapshot.contributions.values() for c, x in per.items()}
                    assert used.keys() == {"a", "liar"} and used["a"] == 10.0, (r, used)
                    assert used["liar"] == pytest.approx(10.0 / (1 + least), rel=1e-12), (r, used)
                    assert dict(shard.last_round.tokens) == {"a": 10.0, "liar": 10.0}  # as said, for status
                    site = next(s for s in shard.chain.entries[-1]["sites"] if s["cluster"] == "liar")
                    assert (site["staleness"], site["staleness_said"], site["weight"]) == (least, 0, used["liar"])
                    for key, tensor in shard.snapshot.tensors.items():
                        assert torch.equal(a.held[key], tensor), key
        said = [e for e in logs if e["event"] == "staleness_understated"]
        assert [(e["round"], e["declared"], e["least"], e["trained_from"]) for e in said] == [(4, 0, 1, 2)] * 2 + [
            (5, 0, 2, 2)
        ] * 2
    finally:
        a.close()
        liar.close()
