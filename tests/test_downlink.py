"""The compressed downlink: clusters replay each round's outer step from forwarded contributions."""

from __future__ import annotations

import torch

from dilocox.common.config.run import InnerConfig, RunConfig
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.framing import EncodedSlice
from dilocox.sim.inprocess import run_in_process
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import slice_tensors

RUN = "run-downlink"
PARAMS = [("emb", (96, 32)), ("w", (32, 64)), ("b", (64,)), ("gain", ())]


def low_rank_delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in PARAMS:
        if len(shape) == 2:
            out[name] = (torch.randn(shape[0], 3, generator=g) @ torch.randn(3, shape[1], generator=g)) * 0.01
            out[name] += 0.001 * torch.randn(shape, generator=g)
        else:
            out[name] = 0.01 * torch.randn(shape, generator=g)
    return out


def client(addresses, name: str, compressed: bool = True) -> AggregatorClient:
    compressor = (
        TensorCompressor(CompressionConfig(rank_max=4, target_energy=0.5, min_lowrank_numel=256), seed=1)
        if compressed
        else None
    )
    return AggregatorClient(addresses, RUN, name, connect_timeout=10, rpc_timeout=30, compressor=compressor)


def assert_replica_equals_shards(c: AggregatorClient, shards) -> None:
    for shard in shards.shards:
        for key, tensor in shard.snapshot.tensors.items():
            assert torch.equal(c.held[key], tensor), (c.cluster, key)
            if key in shard.optimizer.buffers:
                assert torch.equal(c.outer.buffers[key], shard.optimizer.buffers[key]), (c.cluster, key)


def test_replicas_stay_bit_identical_and_joiners_resync(shard_set):
    shards = shard_set(2, RUN, min_clusters=2)
    a, b = client(shards.addresses, "a"), client(shards.addresses, "b")
    joiner = None
    try:
        a.join(PARAMS)
        b.join(PARAMS)
        theta0 = {n: torch.randn(s) for n, s in PARAMS}
        a.push(0, 1.0, slice_tensors(a.assignment, theta0))
        for c in (a, b):
            assert c.pull(0, wait_seconds=10)[0] == 0
        dense = 4 * sum(t.numel() for t in theta0.values())
        for round_ in range(1, 5):
            for i, c in enumerate((a, b)):
                c.push(round_, 100.0 * (i + 1), slice_tensors(c.assignment, low_rank_delta(10 * round_ + i)))
            for c in (a, b):
                version, _, received = c.pull(round_, wait_seconds=10)
                assert version == round_
                assert received < dense / 4  # the other cluster's compressed payload, not the weights
                assert_replica_equals_shards(c, shards)

        # A cluster joining now pulls weights and momentum in full, then replays like the others.
        joiner = client(shards.addresses, "late")
        joiner.join(PARAMS)
        version, _, received = joiner.pull(0, wait_seconds=10)
        assert version == 4 and received > dense  # θ and momentum, in full
        assert_replica_equals_shards(joiner, shards)
        for i, c in enumerate((a, b, joiner)):
            c.push(5, 50.0, slice_tensors(c.assignment, low_rank_delta(100 + i)))
        for c in (a, b, joiner):
            assert c.pull(5, wait_seconds=10)[0] == 5
            assert_replica_equals_shards(c, shards)

        # A cluster that lost the bytes of its own contribution still replays: it gets them back.
        for i, c in enumerate((a, b, joiner)):
            c.push(6, 50.0, slice_tensors(c.assignment, low_rank_delta(200 + i)))
        # A restarted client keeps no own copies: it says so, and the shards send its part like the others'.
        a._own.clear()
        version, _, received = a.pull(6, wait_seconds=10)
        assert version == 6 and received < dense / 4 and a.pull_kinds == {0: ("rounds", 1, ""), 1: ("rounds", 1, "")}
        assert_replica_equals_shards(a, shards)
        assert b.pull(6, wait_seconds=10)[0] == 6

        # One whose copy differs from what the shard applied (the summary's digest) resyncs in full.
        for i, c in enumerate((a, b, joiner)):
            c.push(7, 50.0, slice_tensors(c.assignment, low_rank_delta(300 + i)))
        key, item = next(iter(b._own.items()))
        b._own[key] = EncodedSlice(key, item.codec, item.dtype, item.shape, item.payload + b"x")
        version, _, received = b.pull(7, wait_seconds=10)
        shard_of_key = next(s.shard for s in b.assignment if s.key == key)  # the other shard's part still replays
        assert (
            version == 7 and b.pull_kinds[shard_of_key][0] == "full" and b.pull_kinds[1 - shard_of_key][0] == "rounds"
        )
        assert_replica_equals_shards(b, shards)
    finally:
        for c in (a, b, joiner):
            if c is not None:
                c.close()


def test_a_round_only_we_contributed_to_comes_as_one_summary_per_shard(shard_set):
    """Nothing else to forward: each shard sends the version and one digest of our own slices."""
    shards = shard_set(2, RUN, min_clusters=1)
    solo = client(shards.addresses, "solo")
    try:
        solo.join(PARAMS)
        solo.push(0, 1.0, slice_tensors(solo.assignment, {n: torch.randn(s) for n, s in PARAMS}))
        solo.pull(0, wait_seconds=10)
        for round_ in (1, 2, 3):
            solo.push(round_, 10.0, slice_tensors(solo.assignment, low_rank_delta(round_)))
            version, _, received = solo.pull(round_, wait_seconds=10)
            assert version == round_ and solo.held_versions == {0: round_, 1: round_}
            assert received < 2 * 120  # per shard a summary (≈ 60 bytes) and the state digest (≈ 40), no payload
            assert_replica_equals_shards(solo, shards)
    finally:
        solo.close()


def test_default_model_traffic_is_fifty_times_below_dense_fp32():
    """Uplink and downlink per round ≥ 50× below dense fp32 on the
    default model with the default compression (rank ≤ 8 with error feedback, slice bundles; the long
    run measures ≈ 101–103×, docs/performance.md)."""
    config = RunConfig(rounds=4, delay=0, inner=InnerConfig(steps=4, batch_size=4))
    assert config.compress == CompressionConfig()
    result = run_in_process(config, num_clusters=2, num_shards=2, timeout_s=180)
    dense = 4 * result.num_params
    for cluster in result.clusters:
        assert len(cluster.reports) == config.rounds
        for report in cluster.reports[1:]:
            assert dense / report.bytes_up >= 50, (report, dense)
            assert dense / report.bytes_down >= 50, (report, dense)
    # The downlink is the other cluster's uplink (its chunks re-framed with contributor, weight and
    # version: measured +5%) plus one own-summary per shard; per-slice own digests made it ≈ +30%.
    for round_ in range(1, config.rounds):
        up = sum(c.reports[round_].bytes_up for c in result.clusters)
        down = sum(c.reports[round_].bytes_down for c in result.clusters)
        assert down <= 1.1 * up, (round_, up, down)
    for shard in result.shards:  # and every cluster ended on the shards' exact weights
        for key, tensor in shard.snapshot.tensors.items():
            for cluster in result.clusters:
                assert torch.equal(cluster.client.held[key], tensor)


def test_a_replica_several_versions_behind_replays_the_rounds_the_shards_keep(shard_set):
    """A cluster restarted from a checkpoint's replica (weights, momentum,
    versions) pulls only the rounds since — each shard keeps the last `keep_rounds` versions' contributions
    — and ends bit-identical to the shards; further behind than they keep, it pulls in full and says why."""
    shards = shard_set(2, RUN, min_clusters=2, keep_rounds=3)
    a, b = client(shards.addresses, "a"), client(shards.addresses, "b")
    resumed = []
    names = [name for name, _ in PARAMS]
    try:
        a.join(PARAMS)
        b.join(PARAMS)
        a.push(0, 1.0, slice_tensors(a.assignment, {n: torch.randn(s) for n, s in PARAMS}))
        for c in (a, b):
            c.pull(0, wait_seconds=10)
        dense = 4 * sum(torch.Size(s).numel() for _, s in PARAMS)
        saved = None
        for round_ in range(1, 8):
            for i, c in enumerate((a, b)):
                c.push(round_, 100.0 * (i + 1), slice_tensors(c.assignment, low_rank_delta(10 * round_ + i)))
            for c in (a, b):
                assert c.pull(round_, wait_seconds=10)[0] == round_
            if round_ == 2:
                saved = b.replica_state(names)  # what b's checkpoint of round 3 holds (version 2)
            if round_ in (5, 7):  # 3 versions behind: replayed; 5 behind: more than the shards keep
                again = client(shards.addresses, "b")
                resumed.append(again)
                assert again.restore_replica(saved, names) == len(b.assignment)
                again.join(PARAMS)
                assert again.resumed.versions == {0: 2, 1: 2} and again.resumed.refused == {}
                version, _, received = again.pull(0, wait_seconds=10)
                assert version == round_
                assert_replica_equals_shards(again, shards)
                if round_ == 5:
                    assert again.pull_kinds == {0: ("rounds", 3, ""), 1: ("rounds", 3, "")}
                    assert received < dense / 2  # three compressed rounds against 8 B per parameter
                else:
                    assert {kind for kind, _, _ in again.pull_kinds.values()} == {"full"} and received > dense
                    assert "--keep-rounds" in again.pull_kinds[0][2]
    finally:
        for c in (a, b, *resumed):
            c.close()


def test_a_replica_at_the_shards_version_pulls_nothing_but_the_digest(shard_set):
    """A restart that missed no round: the shards send no weights, only the state digest it checks."""
    shards = shard_set(1, RUN, min_clusters=1)
    a = client(shards.addresses, "a")
    again = None
    try:
        a.join(PARAMS)
        a.push(0, 1.0, slice_tensors(a.assignment, {n: torch.randn(s) for n, s in PARAMS}))
        a.pull(0, wait_seconds=10)
        a.push(1, 10.0, slice_tensors(a.assignment, low_rank_delta(1)))
        assert a.pull(1, wait_seconds=10)[0] == 1
        saved = a.replica_state([name for name, _ in PARAMS])
        again = client(shards.addresses, "a")
        again.restore_replica(saved, [name for name, _ in PARAMS])
        again.join(PARAMS)
        version, _, received = again.pull(0, wait_seconds=10)
        assert version == 1 and again.pull_kinds == {0: ("current", 0, "")} and received < 200
        assert again.replay_check.checked == 1  # the digest was compared
        assert_replica_equals_shards(again, shards)
    finally:
        for c in (a, again):
            if c is not None:
                c.close()
