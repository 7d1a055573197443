"""The end-of-run flush: what error feedback still holds back reaches the shards once, densely quantised,
and every cluster ends on the shards' global model."""

from __future__ import annotations

import pytest
import torch

from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.quantize import relative_error_bound
from dilocox.worker.exchange.aggregator_client import AggregatorClient
from dilocox.worker.exchange.cluster import DilocoCluster
from tests.test_delay import ToyTrainer, run_concurrently

RUN = "run-flush"
# Rank 1 on the toy model's 3×6 weight: every round leaves a sizeable residual to flush.
LOW_RANK = dict(rank_max=1, min_lowrank_numel=1)


def test_flushing_a_zero_delta_sends_the_residual_densely():
    compressor = TensorCompressor(CompressionConfig(**LOW_RANK), seed=3, track_deficit=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        last = torch.randn(24, 40, generator=g)
        compressor.compress("w", last)
    residual = compressor.residual("w").clone()
    assert float(residual.norm()) > 0.5 * float(last.norm())  # rank 1 of a full-rank matrix left most behind

    encoded = compressor.compress("w", torch.zeros(24, 40), codec="int4")

    assert encoded.codec == "int4" and encoded.rank is None  # dense, whatever the configured codec
    bound = relative_error_bound(4) * float(residual.abs().max()) * 1.0001
    assert float((encoded.decoded - residual).abs().max()) <= bound
    # Error feedback's bookkeeping holds across the flush: what is left is exactly what never arrived.
    assert torch.equal(compressor.residual("w"), residual - encoded.decoded)
    torch.testing.assert_close(compressor.deficit["w"], compressor.residual("w"), rtol=0, atol=1e-5)
    assert float(compressor.residual("w").norm()) < 0.2 * float(residual.norm())


def test_flush_codec_is_validated_and_needs_error_feedback():
    with pytest.raises(ValueError, match="flush_codec"):
        CompressionConfig(flush_codec="lowrank")
    assert TensorCompressor(CompressionConfig()).flushes
    assert not TensorCompressor(CompressionConfig(flush_codec="none")).flushes
    assert not TensorCompressor(CompressionConfig(error_feedback=False)).flushes  # nothing held back to flush
    # classic error feedback: the cluster re-learns what it dropped, so flushing it would count it twice
    assert not TensorCompressor(CompressionConfig(local_residual=False)).flushes


def _run(shards, flush_codec: str, delay: int, rounds: int = 4, clusters: int = 2) -> list[DilocoCluster]:
    config = CompressionConfig(**LOW_RANK, flush_codec=flush_codec)
    runs = []
    for i in range(clusters):
        client = AggregatorClient(
            shards.addresses,
            RUN,
            f"c{i}",
            connect_timeout=10,
            rpc_timeout=30,
            compressor=TensorCompressor(config, seed=5),
        )
        runs.append(DilocoCluster(ToyTrainer(10 + i), client, rounds=rounds, inner_steps=3, delay=delay))
    run_concurrently(runs)
    return runs


def _assert_on_the_shards_model(clusters: list[DilocoCluster], shards) -> None:
    for cluster in clusters:
        for s in cluster.slices:
            want = shards.shards[s.shard].snapshot.tensors[s.key]
            assert torch.equal(s.view(cluster.params[s.name].detach()), want.reshape(s.slice_shape)), (
                cluster.client.cluster,
                s.key,
            )


@pytest.mark.parametrize("delay", [0, 1])
def test_run_ends_on_the_global_model_with_the_residuals_flushed(shard_set, delay):
    shards = shard_set(2, RUN, min_clusters=2)
    rounds = 4
    clusters = _run(shards, "int4", delay, rounds)
    assert all(s.version == rounds + 1 for s in shards.shards)  # the rounds, then the flush round
    _assert_on_the_shards_model(clusters, shards)  # bit for bit, no cluster's own residual on top
    for cluster in clusters:
        flush = cluster.flush
        assert flush is not None and flush["round"] == rounds + 1 and flush["codec"] == "int4"
        assert flush["bytes_up"] > 0 and flush["bytes_down"] > 0
        assert flush["residual_norm"] > 0
        assert cluster.client.compressor.residual_norm() < 0.2 * flush["residual_norm"]  # the flush delivered it
    assert cluster.final_eval_loss == pytest.approx(cluster.trainer.evaluate())


@pytest.mark.parametrize("delay", [0, 1])
def test_without_a_flush_both_forms_end_on_the_last_rounds_global_model(shard_set, delay):
    """Synchronous runs used to end on θ_T minus their own residual; now both forms end on θ_T."""
    shards = shard_set(1, RUN, min_clusters=2)
    rounds = 3
    clusters = _run(shards, "none", delay, rounds)
    assert shards.shards[0].version == rounds
    assert all(c.flush is None for c in clusters)
    assert all(c.client.compressor.residual_norm() > 0 for c in clusters)  # there was something to leave out
    _assert_on_the_shards_model(clusters, shards)


def test_a_cluster_resumed_after_the_flush_skips_it(shard_set):
    """A worker restarted after its run ended finds the flush round closed with its own flush in it: the
    shard answers the repeated flush as a duplicate (nothing applied twice), and the worker ends on the
    shards' model instead of failing."""
    shards = shard_set(1, RUN, min_clusters=1)
    _run(shards, "int4", delay=1, rounds=2, clusters=1)
    assert shards.shards[0].version == 3
    published = shards.shards[0].snapshot
    again = _run(shards, "int4", delay=1, rounds=2, clusters=1)[0]
    assert again.reports == [] and shards.shards[0].snapshot is published
    assert shards.shards[0].version == 3
    _assert_on_the_shards_model([again], shards)
