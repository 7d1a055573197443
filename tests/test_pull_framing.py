"""A version's pull chunks are framed once for every cluster that pulls the same bytes
(server/serving/pull_framing.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from dilocox.proto import dilocox_pb2 as pb
from dilocox.server.serving.pull_framing import PullFramings, SharedFraming
from dilocox.worker.exchange.cluster import slice_tensors
from tests.test_downlink import PARAMS, assert_replica_equals_shards, client, low_rank_delta


def counted(n: int, made: list[int], fail_at: int | None = None):
    def source():
        for i in range(n):
            if i == fail_at:
                raise RuntimeError("framing failed")
            made.append(i)
            yield pb.TensorChunk(name=f"c{i}", offset=i)

    return source


def _offset(chunk: bytes) -> int:
    return pb.TensorChunk.FromString(chunk).offset  # a shared framing hands out each chunk's wire bytes


def test_readers_of_a_shared_framing_get_every_chunk_and_it_is_made_once():
    made: list[int] = []
    shared = SharedFraming(counted(50, made)(), reserved_bytes=0)
    first, second = iter(shared), iter(shared)
    read_first = [next(first) for _ in range(10)]  # the second reader starts while the first is mid-stream
    read_second = list(second)
    read_first += list(first)
    assert [_offset(c) for c in read_first] == [_offset(c) for c in read_second] == list(range(50))
    assert made == list(range(50))

    results: list[list[int]] = []
    made.clear()
    shared = SharedFraming(counted(200, made)(), reserved_bytes=0)
    threads = [threading.Thread(target=lambda: results.append([_offset(c) for c in shared])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [list(range(200))] * 8 and made == list(range(200))


def test_a_framing_that_fails_fails_every_reader():
    shared = SharedFraming(counted(10, [], fail_at=3)(), reserved_bytes=0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="framing failed"):
            list(shared)


def test_entries_are_shared_per_key_and_version_within_the_budget():
    framings = PullFramings(budget_bytes=1000)
    made: list[int] = []
    slices = framings.slice_set(["a", "b"])
    assert framings.slice_set(("a", "b")) == slices and framings.slice_set(["b"]) != slices
    one = framings.framed(("full", "", slices), 3, 400, counted(4, made))
    assert framings.framed(("full", "", slices), 3, 400, counted(4, made)) is one  # the same key and version: shared
    list(one)
    list(one)
    assert made == [0, 1, 2, 3] and (framings.streams_framed, framings.streams_shared) == (1, 1)
    other = framings.framed(("weights", "", slices), 3, 500, counted(2, made))
    assert other is not one and framings.streams_framed == 2
    # Over what is left of the budget: the least recently used entry goes first, then it fits.
    third = framings.framed(("full", "", framings.slice_set(["b"])), 3, 500, counted(2, made))
    assert framings.framed(("full", "", slices), 3, 400, counted(4, made)) is not one  # evicted: framed anew
    assert isinstance(third, SharedFraming)
    # Larger than the whole budget: framed for this pull alone, every time.
    big = [framings.framed(("contributions", 3, "c", slices), 3, 5000, counted(1, made)) for _ in range(2)]
    assert not any(isinstance(b, SharedFraming) for b in big) and framings.streams_unshared == 2
    # A pull of a newer version drops every older version's entries.
    newer = framings.framed(("full", "", slices), 4, 100, counted(1, made))
    assert isinstance(newer, SharedFraming) and all(key[0] == 4 for key in framings._entries)


def test_pulls_are_the_same_bits_shared_or_not_and_shared_across_clusters(shard_set):
    """Three clusters replay rounds from forwarded contributions and one pulls in full: every replica equals
    the shards' weights and momentum, and each shard framed each contribution once for its two readers."""
    results = {}
    for cache in (0, 64 << 20):
        shards = shard_set(2, "run-downlink", min_clusters=3, pull_cache_bytes=cache)
        clients = [client(shards.addresses, name) for name in ("a", "b", "c")]
        try:
            for c in clients:
                c.join(PARAMS)
            theta0 = {n: torch.randn(s, generator=torch.Generator().manual_seed(7)) for n, s in PARAMS}
            clients[0].push(0, 1.0, slice_tensors(clients[0].assignment, theta0))
            for c in clients:
                assert c.pull(0, wait_seconds=10)[0] == 0
            received = []
            for round_ in range(1, 4):
                for i, c in enumerate(clients):
                    c.push(round_, 10.0 * (i + 1), slice_tensors(c.assignment, low_rank_delta(10 * round_ + i)))
                for c in clients:
                    version, _, got = c.pull(round_, wait_seconds=10)
                    assert version == round_
                    received.append(got)
            for c in clients:
                assert_replica_equals_shards(c, shards)
            results[cache] = (received, {k: t.clone() for s in shards.shards for k, t in s.snapshot.tensors.items()})
            framings = [server.framings for server in shards.servers]
            if cache:
                # Per shard and round, each cluster's contribution is read by the two others: framed once, shared once.
                assert all(f.streams_framed >= 3 * 3 and f.streams_shared >= 3 * 3 for f in framings), [
                    (f.streams_framed, f.streams_shared) for f in framings
                ]
            else:
                assert all(f.streams_framed == 0 and f.streams_shared == 0 and f.streams_unshared > 0 for f in framings)
        finally:
            for c in clients:
                c.close()
            shards.stop()
    (bytes_off, weights_off), (bytes_on, weights_on) = results[0], results[64 << 20]
    assert bytes_off == bytes_on
    assert weights_off.keys() == weights_on.keys() and all(
        torch.equal(weights_off[k], weights_on[k]) for k in weights_off
    )
