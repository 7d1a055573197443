"""`dilocox bench faults`: the fault kinds on real payloads, the in-process run's faulty-site hook, and the
drill end to end on a tiny model (a ×100 site flagged and left out by both shards; no flag in the clean run)."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from dilocox.bench import faults
from dilocox.bench.fault_kinds import EXPONENT_BITS, SiteFault, flip_exponent_bits
from dilocox.common.config.run import InnerConfig, ModelConfig, RunConfig
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.common.wire.lowrank import lowrank_factors
from dilocox.sim.inprocess import run_in_process

MATRIX, VECTOR = SliceKey("w", 0, 64), SliceKey("b", 0, 96)


def sent(compressor: TensorCompressor, key: SliceKey, tensor: torch.Tensor) -> EncodedSlice:
    e = compressor.compress(key, tensor)
    return EncodedSlice(key, e.codec, e.dtype, tuple(e.shape), bytearray(e.payload))


@pytest.fixture
def honest() -> list[EncodedSlice]:
    """A low-rank slice and an int4 one, as the default compression sends them."""
    g = torch.Generator().manual_seed(3)
    compressor = TensorCompressor(CompressionConfig(), seed=1)
    matrix = (torch.randn(64, 4, generator=g) @ torch.randn(4, 96, generator=g)) * 1e-2
    items = [sent(compressor, MATRIX, matrix), sent(compressor, VECTOR, torch.randn(96, generator=g) * 1e-3)]
    assert [i.codec for i in items] == ["lowrank", "int4"]
    return items


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("kind", ["scale", "sign", "noise", "bitflip", "bitflip-low"])
def test_each_kind_changes_what_the_faulty_site_sends_in_the_same_codec(kind, honest):
    fault = SiteFault("site-3", kind, from_round=3, bitflip_fraction=0.05)
    for item in honest:
        assert fault("site-0", 5, item) is item and fault("site-3", 2, item) is item  # other sites, earlier rounds
        out = fault("site-3", 5, item)
        assert (out.key, out.codec, out.shape) == (item.key, item.codec, item.shape) and out.payload != item.payload
        if (
            kind == "bitflip"
        ):  # the top exponent bit can make a payload the shards refuse as overflowing: its values stay finite
            assert all(
                torch.isfinite(v).all()
                for v in (lowrank_factors(out.payload) if out.codec == "lowrank" else [out.decode()])
            )
            continue
        before, after = item.decode(), out.decode()
        assert torch.isfinite(after).all()
        if kind == "scale":
            assert float(after.norm() / before.norm()) == pytest.approx(100, rel=1e-3) and cosine(after, before) > 0.999
        elif kind == "sign":
            assert cosine(after, before) < -0.999
        elif kind == "noise":  # the same norm (to within quantisation), pointing nowhere in particular
            assert (
                float(after.norm() / before.norm()) == pytest.approx(1, rel=0.15) and abs(cosine(after, before)) < 0.3
            )
    assert fault.flipped > 0 if kind.startswith("bitflip") else fault.flipped == 0


def test_the_evasions_stay_under_the_checks_bounds_by_construction(honest):
    """underbound: × 9 (under the default 10×); drift: × 1.3 per round of the fault (the third: 1.3³); halfsign:
    a tensor negated whole or not at all, by its name (so half the model's tensors)."""
    import zlib

    under, drift, half = (SiteFault("site-3", kind, from_round=3) for kind in ("underbound", "drift", "halfsign"))
    for item in honest:
        before = item.decode()
        assert float(under("site-3", 4, item).decode().norm() / before.norm()) == pytest.approx(9, rel=1e-3)
        assert float(drift("site-3", 5, item).decode().norm() / before.norm()) == pytest.approx(1.3**3, rel=1e-3)
        negated = bool(zlib.crc32(item.key.name.encode()) % 2)
        assert cosine(half("site-3", 4, item).decode(), before) == pytest.approx(-1.0 if negated else 1.0, abs=1e-3)
    assert {bool(zlib.crc32(k.name.encode()) % 2) for k in (MATRIX, VECTOR)} == {True, False}  # the fixture shows both


def test_flips_hit_only_exponent_bits_and_the_low_kind_stays_far_from_overflow():
    g = torch.Generator().manual_seed(0)
    values = torch.rand(20_000, generator=g) * 0.1 + 1e-4
    for kind, limit in (("bitflip-low", 2.0**65), ("bitflip", 2.0**129)):
        flipped = values.clone()
        count = flip_exponent_bits(flipped, 0.05, g, EXPONENT_BITS[kind])
        changed = flipped != values
        assert int(changed.sum()) == count > 500
        diff = flipped.view(torch.int32) ^ values.view(torch.int32)
        assert ((diff & ~0x7F800000) == 0).all()  # sign and mantissa untouched
        ratio = (flipped[changed].double() / values[changed].double()).abs()
        assert ratio.max() < limit and torch.isfinite(flipped).all()
        if kind == "bitflip":
            assert ratio.max() > 2.0**100  # the top bit: ~10³⁶ for values of 0.01
    ones = torch.full((1000,), 1.5)  # [1, 2): the top bit would make them Inf, so it is not flipped there
    flip_exponent_bits(ones, 1.0, g, (30,))
    assert (ones == 1.5).all()


def test_replay_sends_the_exact_payload_of_the_round_before_the_fault(honest):
    fault = SiteFault("site-3", "replay", from_round=3)
    fault("site-3", 1, honest[0])
    fault("site-3", 2, honest[0])  # the last honest round's payload: what is replayed
    newer = EncodedSlice(MATRIX, "lowrank", honest[0].dtype, honest[0].shape, bytearray(honest[0].payload))
    assert fault("site-3", 3, newer) is honest[0] and fault("site-3", 7, newer) is honest[0]
    with pytest.raises(ValueError, match="fault-round"):
        SiteFault("site-3", "replay", from_round=1)


TINY = RunConfig(
    run_id="faults-test",
    rounds=3,
    inner=InnerConfig(steps=2, batch_size=4, warmup_steps=1),
    eval_batches=1,
    model=ModelConfig(n_embd=32, n_head=2, n_layer=1, block_size=32),
)


def test_a_site_failing_mid_run_ends_the_in_process_run_without_waiting_for_the_others():
    """One cluster fails (here its push in round 2); the others then wait for a round that never closes:
    the run raises its error without waiting for them or for its timeout (their clients close within a pull wait, 30
    s)."""

    def broken(cluster: str, round_: int, item: EncodedSlice) -> EncodedSlice:
        if cluster == "cluster-1" and round_ == 2:
            raise RuntimeError("the drill's broken site")
        return item

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="broken site"):
        run_in_process(TINY, num_clusters=3, num_shards=1, push_fault=broken, timeout_s=600)
    # Waiting for the others is waiting for the timeout (their round never closes): half of it tells the two
    # apart on any machine; how fast the error arrives is not this test's business.
    assert time.monotonic() - started < 300


@pytest.mark.parametrize("split", ["interleaved", "contiguous"])  # every site a sample of the text, or its own stretch
def test_the_drill_flags_and_leaves_out_a_x100_site_and_raises_no_false_alarm(tmp_path, split):
    parser = argparse.ArgumentParser()
    faults.add_arguments(parser)
    args = parser.parse_args(
        [
            "--kinds",
            "scale",
            "--modes",
            "exclude",
            "--rounds",
            "4",
            "--fault-round",
            "2",
            "--inner-steps",
            "3",
            "--n-embd",
            "32",
            "--data-split",
            split,
        ]
    )
    text = faults.run(args, tmp_path)
    rows = {row["kind"]: row for row in json.loads((tmp_path / "faults.json").read_text())["rows"]}
    assert set(rows) == {"clean", "scale"}
    for row in rows.values():
        assert {
            "mode",
            "final_eval_loss",
            "loss_vs_clean",
            "first_flagged",
            "flagged_rounds",
            "excluded_rounds",
            "false_alarms",
            "honest_min_cosine",
        } <= set(row) and "error" not in row
        assert row["final_eval_loss"] == row["final_eval_loss"] and row["false_alarms"] == 0, row
    assert rows["clean"]["excluded_rounds"] == "- / -" and rows["clean"]["loss_vs_clean"] == "+0.00%"
    scale = rows["scale"]
    # Both shards flag it from its first faulty round on, every training round, and leave it out — of the
    # end-of-run flush (round 5, not judged) too: it is quarantined by then.
    assert (
        scale["first_flagged"] == "2 / 2"
        and scale["flagged_rounds"] == "3/3 / 3/3"
        and scale["excluded_rounds"] == "2-5 / 2-5"
    )
    assert "outsized" in scale["reasons"]
    assert abs(float(scale["loss_vs_clean"].rstrip("%"))) < 5  # left out: the others' run, not a ×100 one
    assert "no false alarm: met" in text and "| scale | exclude |" in text
