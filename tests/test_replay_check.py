"""Every replayed outer step is checked against the shard's state digest; a cluster whose
replay differs resyncs in the same round and is counted; no false alarm on identical hardware; a shard
that replays without a valid digest is refused before anything is applied. Real shards over gRPC."""

from __future__ import annotations

import pytest
import torch

from dilocox.common.config.run import InnerConfig, RunConfig
from dilocox.common.wire.framing import is_state_digest
from dilocox.proto import dilocox_pb2 as pb
from dilocox.server.serving.servicer import AggregatorServicer
from dilocox.sim.inprocess import run_in_process
from dilocox.worker.exchange.cluster import slice_tensors
from dilocox.worker.metrics import WorkerMetrics
from tests.test_downlink import PARAMS, assert_replica_equals_shards, client, low_rank_delta


def _rounds(clients, shards, rounds) -> None:
    for round_ in rounds:
        for i, c in enumerate(clients):
            c.push(round_, 10.0 + i, slice_tensors(c.assignment, low_rank_delta(100 * i + round_)))
        for c in clients:
            assert c.pull(round_, wait_seconds=10)[0] == round_


def _start(shards, names=("a", "b")):
    clients = [client(shards.addresses, name) for name in names]
    for c in clients:
        c.join(PARAMS)
    clients[0].push(0, 1.0, slice_tensors(clients[0].assignment, {n: torch.randn(s) for n, s in PARAMS}))
    for c in clients:
        c.pull(0, wait_seconds=10)
    return clients


def test_replay_mismatch_of_one_ulp_is_caught_in_the_same_round_and_resynced_once(shard_set):
    shards = shard_set(2, "run-downlink", min_clusters=2)
    a, b = clients = _start(shards)
    try:
        _rounds(clients, shards, (1, 2))
        key = next(k for k in b.held if b.held[k].numel() > 1)
        off = b.held[key].clone()
        # One ulp of one element: the largest, whose ulp the next step's subtraction cannot round away (an
        # element much smaller than its update loses its last bit in `θ − η·step`; the test flaked on that).
        i = int(off.view(-1).abs().argmax())
        off.view(-1)[i] = torch.nextafter(off.view(-1)[i], torch.tensor(float("inf")))
        b.held[key] = off
        assert b.replay_check.mismatches == 0
        _rounds(clients, shards, (3,))  # the replay of round 3 starts from the wrong copy: caught now
        assert b.replay_check.mismatches == 1
        assert_replica_equals_shards(b, shards)  # resynced before the next round
        _rounds(clients, shards, (4, 5))
        assert b.replay_check.mismatches == 1 and a.replay_check.mismatches == 0  # once, and never for a
        assert_replica_equals_shards(b, shards)
        assert sum(s.status()["replay_mismatches"] for s in shards.shards) >= 1  # reported with b's pulls
        metrics = WorkerMetrics(b)
        assert metrics.registry.get_sample_value("dilocox_replay_mismatches_total") == 1
    finally:
        for c in clients:
            c.close()


class _DigestTampering(AggregatorServicer):
    """A shard (in-process servicer) whose contributions pulls lose or corrupt their state digest."""

    mode = "drop"

    def stream(self, snapshot, request):
        for sent in super().stream(snapshot, request):  # each chunk's wire bytes
            chunk = pb.TensorChunk.FromString(sent)
            if is_state_digest(chunk):
                if self.mode == "drop":
                    continue
                sent = pb.TensorChunk(
                    version=chunk.version, state_digest=True, payload_sha256=b"short"
                ).SerializeToString()
            yield sent


@pytest.mark.parametrize("mode", ["drop", "corrupt"])
def test_replay_check_refuses_a_bad_or_missing_digest_before_applying(shard_set, monkeypatch, mode):
    monkeypatch.setattr(_DigestTampering, "mode", mode)
    monkeypatch.setattr("dilocox.server.serving.grpc_server.AggregatorServicer", _DigestTampering)
    shards = shard_set(1, "run-downlink", min_clusters=2)
    a, b = clients = _start(shards)
    try:
        for i, c in enumerate(clients):
            c.push(1, 10.0, slice_tensors(c.assignment, low_rank_delta(i + 1)))
        before = {k: t.clone() for k, t in b.held.items()}
        with pytest.raises(ValueError, match="state digest"):
            b.pull(1, wait_seconds=10)
        assert all(torch.equal(b.held[k], t) for k, t in before.items()) and b.held_versions == {
            0: 0
        }  # nothing applied
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("delay", [0, 1])
def test_replay_check_no_false_alarm_over_twenty_rounds(delay):
    """Identical hardware: error feedback and bundles on (the defaults), two shards, a cluster whose
    round-0 pull is a full one and every later one a replay."""
    config = RunConfig(rounds=20, delay=delay, inner=InnerConfig(steps=2, batch_size=4))
    assert config.wire.replay_check and config.compress.error_feedback
    checks = []
    result = run_in_process(
        config,
        num_clusters=2,
        num_shards=2,
        timeout_s=300,
        on_round=lambda client, _report: checks.append((client.replay_check.checked, client.replay_check.mismatches)),
    )
    assert len(result.clusters) == 2 and max(checked for checked, _ in checks) >= 20  # the replays were checked …
    assert all(mismatches == 0 for _, mismatches in checks)  # … and none differed


def test_replay_check_no_false_alarm_for_a_cluster_that_joins_late(shard_set):
    shards = shard_set(2, "run-downlink", min_clusters=2)
    clients = _start(shards)
    try:
        _rounds(clients, shards, (1, 2, 3))
        late = client(shards.addresses, "late")
        clients.append(late)
        late.join(PARAMS)
        assert late.pull(0, wait_seconds=10)[0] == 3  # in full: nothing to replay yet
        _rounds(clients, shards, (4, 5, 6))
        assert late.replay_check.checked >= 6 and all(c.replay_check.mismatches == 0 for c in clients)
        assert_replica_equals_shards(late, shards)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("rows,cols,rank", [(130, 70, 5), (64, 1, 1), (3, 200, 3)])
def test_replay_check_lowrank_decode_is_an_ordered_sum_of_rank_one_terms(rows, cols, rank):
    """The decode every shard and cluster runs rounds one elementwise IEEE operation at a time, so it
    does not depend on a BLAS's summation order: the same as the plain ordered sum, bit for bit."""
    from dilocox.common.wire.lowrank import ordered_product

    g = torch.Generator().manual_seed(rows + cols + rank)
    p, q = torch.randn(rows, rank, generator=g), torch.randn(cols, rank, generator=g)
    plain = p[:, 0:1] * q[:, 0]
    for i in range(1, rank):
        plain = plain + p[:, i : i + 1] * q[:, i]
    product = ordered_product(p.T.contiguous(), q.T.contiguous())
    assert torch.equal(product, plain)
    torch.testing.assert_close(product, p @ q.T, rtol=1e-5, atol=1e-5)


def test_a_cluster_from_before_the_named_digest_still_gets_sha256_and_checks_clean(shard_set):
    """The pull names the digest's hash (xxh3-128 by default); a pull that names none — a cluster built
    before the choice existed — gets sha256's, and both check clean against the same replay."""
    from dilocox.common.wire.replica_digest import SHA256, XXH3_128

    shards = shard_set(1, "run-downlink", min_clusters=2)
    a, b = clients = _start(shards)
    try:
        assert a.replay_check.digest == XXH3_128
        b.replay_check.digest = SHA256
        _rounds(clients, shards, (1, 2, 3))
        assert a.replay_check.checked >= 3 and b.replay_check.checked >= 3
        assert a.replay_check.mismatches == 0 and b.replay_check.mismatches == 0
        assert_replica_equals_shards(b, shards)
    finally:
        for c in clients:
            c.close()


def test_a_pull_naming_an_unknown_digest_is_refused_before_anything_streams(shard_set):
    import grpc

    from dilocox.proto import dilocox_pb2_grpc as pb_grpc

    shards = shard_set(1, "run-downlink", min_clusters=1)
    a = client(shards.addresses, "a")
    try:
        a.join(PARAMS)
        version = shards.shards[0].status()["version"]
        with grpc.insecure_channel(shards.addresses[0]) as channel:
            request = pb.PullRequest(
                run_id="run-downlink",
                cluster="a",
                min_version=0,
                wait_seconds=1,
                have_version=-1,
                check_replay=True,
                replay_digest="md5",
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(pb_grpc.AggregatorStub(channel).Pull(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and "md5" in refused.value.details()
        assert shards.shards[0].status()["version"] == version  # the shard carries on, nothing changed
        assert a.status_each()[0].run_id == "run-downlink"  # and still answers
    finally:
        a.close()


def test_slice_digests_differ_by_function_and_by_one_ulp():
    from dilocox.common.wire.framing import SliceKey
    from dilocox.common.wire.replica_digest import SHA256, XXH3_128, slice_digest, state_digest

    key = SliceKey("w", 0, 4)
    w, v = torch.randn(4, 3), torch.randn(4, 3)
    assert slice_digest(key, w, v, XXH3_128) != slice_digest(key, w, v, SHA256)
    off = w.clone()
    off[0, 0] = torch.nextafter(off[0, 0], torch.tensor(float("inf")))
    for digest in (SHA256, XXH3_128):
        assert slice_digest(key, w, v, digest) == slice_digest(key, w.clone(), v.clone(), digest)
        assert slice_digest(key, off, v, digest) != slice_digest(key, w, v, digest)
        assert slice_digest(key, w, None, digest) != slice_digest(key, w, v, digest)
        assert len(state_digest([key], {key: w}, {key: v}, digest)) == 32
    with pytest.raises(ValueError, match="unknown state digest"):
        slice_digest(key, w, v, "md5")
