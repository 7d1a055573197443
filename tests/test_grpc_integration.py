"""The aggregation service over real gRPC on localhost: outer update, refusals, big tensors."""

from __future__ import annotations

import grpc
import pytest
import torch

from dilocox.common.config.run import WireConfig
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.framing import SliceKey, encode_slice
from dilocox.proto import dilocox_pb2 as pb
from dilocox.proto import dilocox_pb2_grpc as pb_grpc
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError
from dilocox.worker.exchange.cluster import slice_tensors

RUN = "run-test"
PARAMS = [("tok_emb", (64, 16)), ("blocks.0.w", (16, 48)), ("blocks.0.b", (48,)), ("head", (64, 16)), ("gain", ())]


def random_tensors(seed: int, params=PARAMS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in params}


def assemble_full(
    client: AggregatorClient, pulled: dict[SliceKey, torch.Tensor], params=PARAMS
) -> dict[str, torch.Tensor]:
    full = {name: torch.full(shape, float("nan")) for name, shape in params}
    for s in client.assignment:
        s.view(full[s.name]).copy_(pulled[s.key])
    return full


def test_outer_update_over_grpc_matches_torch_reference(shard_set):
    """Acceptance 2 (integration): 2 shards, 3 clients pushing known tensors, pulled weights vs torch SGD."""
    shards = shard_set(2, RUN, min_clusters=3)
    weights = {"a": 512.0, "b": 2048.0, "c": 1024.0}
    clients = {c: AggregatorClient(shards.addresses, RUN, c, connect_timeout=10, rpc_timeout=30) for c in weights}
    try:
        theta0 = random_tensors(0)
        infos = {c: client.join(PARAMS) for c, client in clients.items()}
        initialiser = [c for c, info in infos.items() if info.needs_init]
        assert initialiser == ["a"] and infos["a"].needs_init == [0, 1]
        clients["a"].push(0, 1.0, slice_tensors(clients["a"].assignment, theta0))

        ref = {n: torch.nn.Parameter(t.clone()) for n, t in theta0.items()}
        opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=True)
        for round_ in range(1, 5):
            deltas = {c: random_tensors(10 * round_ + i) for i, c in enumerate(weights)}
            for name, p in ref.items():
                p.grad = sum(weights[c] * deltas[c][name] for c in weights) / sum(weights.values())
            opt.step()
            for c, client in clients.items():
                client.push(round_, weights[c], slice_tensors(client.assignment, deltas[c]))
            for client in clients.values():
                version, pulled, received = client.pull(min_version=round_, wait_seconds=10)
                assert version == round_ and received > 0
                full = assemble_full(client, pulled)
                for name in ref:
                    torch.testing.assert_close(full[name], ref[name].detach(), rtol=1e-6, atol=1e-6)
        statuses = clients["a"].status_each()
        assert [s.version for s in statuses] == [4, 4] and all(s.clusters == ["a", "b", "c"] for s in statuses)
        assert sum(s.num_elements for s in statuses) == sum(t.numel() for t in theta0.values())
    finally:
        for client in clients.values():
            client.close()


def _stub(address: str) -> pb_grpc.AggregatorStub:
    return pb_grpc.AggregatorStub(grpc.insecure_channel(address))


def _state(shard):
    snap = shard.snapshot
    acc = shard.accumulator
    return (
        shard.version,
        {k: v.clone() for k, v in snap.tensors.items()},
        {k: v.clone() for k, v in shard.optimizer.buffers.items()},
        {f"{k}/{c}": v.slice.decode().clone() for k, per in acc.contributions.items() for c, v in per.items()}
        if acc
        else {},
    )


def _same(a, b) -> bool:
    return a[0] == b[0] and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[1:], b[1:])
    )


def test_bad_requests_get_distinct_codes_and_change_nothing(shard_set):
    """Acceptance 5: digest mismatch, wrong round, unowned name, wrong shape → precise codes, state intact."""
    shards = shard_set(1, RUN, min_clusters=2)
    good = AggregatorClient(shards.addresses, RUN, "good", connect_timeout=10, rpc_timeout=30)
    other = AggregatorClient(shards.addresses, RUN, "other", connect_timeout=10, rpc_timeout=30)
    try:
        good.join(PARAMS)
        other.join(PARAMS)
        good.push(0, 1.0, slice_tensors(good.assignment, random_tensors(0)))
        good.push(1, 100.0, slice_tensors(good.assignment, random_tensors(1)))  # round 1 half-collected
        shard = shards.shards[0]
        before = _state(shard)
        # Kept as vetted on arrival (codecs.vet, by the assembly): the close decodes them without a second pass.
        assert all(c.slice.vetted for per in shard.accumulator.contributions.values() for c in per.values())
        stub = _stub(shards.addresses[0])

        wrong_model = [("tok_emb", (65, 16))] + PARAMS[1:]
        with pytest.raises(grpc.RpcError) as info:
            stub.Join(
                pb.JoinRequest(
                    run_id=RUN,
                    cluster="intruder",
                    model_digest=model_digest(wrong_model),
                    params=[pb.ParamSpec(name=n, shape=list(s)) for n, s in wrong_model],
                ),
                timeout=10,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model digest" in info.value.details() and "different parameter names or shapes" in info.value.details()

        def push(round_: int, key: SliceKey, tensor: torch.Tensor, cluster: str = "other"):
            chunks = [pb.PushMessage(chunk=chunk) for chunk in encode_slice(key, tensor)]
            head = pb.PushHeader(run_id=RUN, cluster=cluster, round=round_, weight=10.0, chunks=len(chunks))
            return stub.Push(iter([pb.PushMessage(header=head), *chunks]), timeout=10)

        owned = next(iter(shard.owned.values()))
        good_tensor = torch.zeros(owned.slice_shape)
        refusals = [
            (
                lambda: push(2, owned.key, good_tensor),
                grpc.StatusCode.FAILED_PRECONDITION,
                "round 2 is not open yet; the open round is 1",
            ),
            (
                lambda: push(0, owned.key, good_tensor),
                grpc.StatusCode.FAILED_PRECONDITION,
                "round 0 (initial weights) is closed",
            ),
            (
                lambda: push(1, SliceKey("not.a.param", 0, 4), torch.zeros(4, 16)),
                grpc.StatusCode.NOT_FOUND,
                "does not own not.a.param[0:4]",
            ),
            (lambda: push(1, owned.key, torch.zeros(3, 3)), grpc.StatusCode.INVALID_ARGUMENT, "expected shape"),
            (
                lambda: push(1, owned.key, good_tensor, cluster="never-joined"),
                grpc.StatusCode.FAILED_PRECONDITION,
                "has not joined",
            ),
        ]
        for call, code, message in refusals:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code, info.value.details()
            assert message in info.value.details()
            assert _same(before, _state(shard))
        assert (
            len({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}) == 3
        )

        # The shard keeps serving: the well-formed push completes the round.
        other.push(1, 100.0, slice_tensors(other.assignment, random_tensors(2)))
        version, _, _ = other.pull(min_version=1, wait_seconds=10)
        assert version == 1
        with pytest.raises(AggregatorError) as refused:
            AggregatorClient(shards.addresses, "wrong-run", "x", connect_timeout=10).join(PARAMS)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        good.close()
        other.close()


def test_large_tensors_stream_within_message_limits(shard_set):
    """Acceptance 3: a 64 MiB tensor, and a parameter set of ≥ 100M elements, push and pull through."""
    big = [("huge", (4096, 4096))]  # 16M fp32 = 64 MiB in one tensor
    many = big + [(f"layer{i}", (4096, 4096)) for i in range(5)] + [("tail", (1_000_000,))]  # 101.7M elements
    total = sum(torch.Size(s).numel() for _, s in many)
    assert total >= 100_000_000
    default_limits = WireConfig(max_message_bytes=4 * 1024 * 1024)  # gRPC's own default receive limit
    shards = shard_set(2, RUN, wire=default_limits)
    client = AggregatorClient(shards.addresses, RUN, "big", wire=default_limits, connect_timeout=10, rpc_timeout=120)
    try:
        client.join(many)
        g = torch.Generator().manual_seed(0)
        tensors = {name: torch.randn(shape, generator=g) for name, shape in many}
        sent = client.push(0, 1.0, slice_tensors(client.assignment, tensors))
        assert sent > 4 * total * 0.8  # random floats barely compress: this really crossed the wire
        version, pulled, received = client.pull(min_version=0, wait_seconds=60)
        assert version == 0 and received > 4 * total * 0.8
        for s in client.assignment:
            assert torch.equal(pulled[s.key], s.view(tensors[s.name])), s.key
    finally:
        client.close()
