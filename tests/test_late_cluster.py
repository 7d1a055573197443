"""A cluster late on one shard only: the shard that closed the round without it
refuses the push, the cluster keeps that part and delivers it with the next round, and the final
weights equal a replay of the shards' rule that includes it — nothing it computed is lost, nothing
delivered twice. Real shards over localhost gRPC, exact fp32 pushes so the replay is checkable."""

from __future__ import annotations

import grpc
import pytest
import torch

from dilocox.common.wire.aggregation import weighted_mean
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError
from dilocox.worker.exchange.cluster import slice_tensors

RUN = "late-run"
PARAMS = [("w", (16, 8)), ("b", (8,)), ("v", (12, 4))]
DEADLINE_S = 0.5


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PARAMS}


def test_late_cluster_part_refused_by_one_shard_arrives_next_round_and_matches_a_replay(shard_set):
    shards = shard_set(2, RUN, round_deadline_s=DEADLINE_S)
    a = AggregatorClient(shards.addresses, RUN, "a", shard_wait_s=0)
    late = AggregatorClient(shards.addresses, RUN, "late", shard_wait_s=0)
    try:
        a.join(PARAMS)
        late.join(PARAMS)
        assert {s.shard for s in a.assignment} == {0, 1}
        theta0 = _tensors(0)
        a.push(0, 1.0, slice_tensors(a.assignment, theta0))
        for client in (a, late):
            client.pull(min_version=0)
        da1, dl1, da2, dl2 = (_tensors(seed) for seed in (1, 2, 3, 4))

        # Round 1: `late` reaches shard 1 in time, shard 0 only after its deadline closed round 1 without it.
        late.push(1, 10.0, slice_tensors(late.assignment, dl1), shards=[1])
        a.push(1, 30.0, slice_tensors(a.assignment, da1))
        shards.wait_version(1)
        with pytest.raises(AggregatorError) as refused:
            late.push(1, 10.0, slice_tensors(late.assignment, dl1), shards=[0])
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        owned0 = [s for s in late.assignment if s.shard == 0]
        assert late.carry.elements == sum(s.numel for s in owned0)
        assert shards.shards[0].last_round.clusters == ("a",) and shards.shards[1].last_round.clusters == ("a", "late")

        # Round 2: `late` rejoins; its push carries round 1's refused part to shard 0 (and only there).
        assert late.join(PARAMS).rejoin
        for client in (a, late):
            client.pull(min_version=1)
        a.push(2, 30.0, slice_tensors(a.assignment, da2))
        late.push(2, 10.0, slice_tensors(late.assignment, dl2))
        for client in (a, late):
            client.pull(min_version=2)
        assert late.carry.elements == sum(s.numel for s in owned0)  # kept once, not again

        # Replay each shard's rule: shard 0 closed round 1 with `a` alone and round 2 with late's Δ2 + Δ1/2.
        for index, shard in enumerate(shards.shards):
            outer = OuterNesterov(0.7, 0.9)
            for s in [s for s in a.assignment if s.shard == index]:
                cut = {
                    name: s.view(t)
                    for name, t in (
                        ("theta", theta0[s.name]),
                        ("da1", da1[s.name]),
                        ("dl1", dl1[s.name]),
                        ("da2", da2[s.name]),
                        ("dl2", dl2[s.name]),
                    )
                }
                round1 = [("a", 30.0, lambda cut=cut: cut["da1"])] + (
                    [] if index == 0 else [("late", 10.0, lambda cut=cut: cut["dl1"])]
                )
                # One round late, the carried part is discounted by its age: × 1/(1 + 1) (common/wire/staleness.py).
                late2 = cut["dl2"] + cut["dl1"] * 0.5 if index == 0 else cut["dl2"]
                late2_tokens = 10.0
                theta1 = outer.step(s.key, cut["theta"], weighted_mean(round1))
                theta2 = outer.step(
                    s.key,
                    theta1,
                    weighted_mean([("a", 30.0, lambda cut=cut: cut["da2"]), ("late", late2_tokens, lambda t=late2: t)]),
                )
                assert torch.equal(shard.snapshot.tensors[s.key], theta2), (index, s.key)
                assert torch.equal(a.held[s.key], theta2) and torch.equal(
                    late.held[s.key], theta2
                )  # both replicas agree
    finally:
        a.close()
        late.close()


def test_a_replica_holding_two_versions_catches_up_to_the_newer(shard_set):
    """A late site can hold the run's last version from one shard and an older one from another: before it
    adopts the final weights it pulls the older shard up to the newer version, so its model is one version
    (AggregatorClient.catch_up_replica)."""
    shards = shard_set(2, RUN, min_clusters=1)
    a = AggregatorClient(shards.addresses, RUN, "a", shard_wait_s=0)
    try:
        a.join(PARAMS)
        a.push(0, 1.0, slice_tensors(a.assignment, _tensors(0)))
        a.pull(min_version=0)
        a.push(1, 10.0, slice_tensors(a.assignment, _tensors(1)), shards=[0])
        a.pull(min_version=1, shards=[0])
        assert a.held_versions == {0: 1, 1: 0} and a.newest_version == 1
        a.push(1, 10.0, slice_tensors(a.assignment, _tensors(1)), shards=[1])
        assert a.catch_up_replica() == 1 and a.held_versions == {0: 1, 1: 1}
        for shard in shards.shards:
            for key, tensor in shard.snapshot.tensors.items():
                assert torch.equal(a.held[key], tensor), key
    finally:
        a.close()
