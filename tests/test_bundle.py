"""Tests of slice bundles: the byte layout (dilocox.common.wire.bundle), how `frame_slices` groups slices
into bundles, and how `assemble_units` opens them — including every refusal of a malformed bundle."""

from __future__ import annotations

import struct

import pytest
import torch
import zstandard

from dilocox.common.wire import codecs
from dilocox.common.wire.assignment import SliceMap, assign_slices
from dilocox.common.wire.bundle import BUNDLE_CODEC, BundleEntry, pack_bundle, unpack_bundle
from dilocox.common.wire.errors import CorruptFrame, InvalidFrame, UnknownCodec
from dilocox.common.wire.framing import EncodedSlice, SliceKey, frame_payload, frame_slices
from dilocox.common.wire.slice_assembly import assemble_units
from dilocox.proto import dilocox_pb2 as pb

PARAMS = [("emb", (64, 16)), ("bias", (16,)), ("norm", (16,)), ("big", (512, 64)), ("tail", (7,))]
SLICES = SliceMap.of(assign_slices(PARAMS, 1))


def _items(codec: str = "int4", seed: int = 0) -> list[EncodedSlice]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for key, shape in SLICES.entries:
        payload, dtype = codecs.encode(codec, torch.randn(shape, generator=g))
        items.append(EncodedSlice(key, codec, dtype, shape, bytes(payload)))
    return items


def _vet(_key: SliceKey, chunk: pb.TensorChunk) -> int:
    return codecs.max_payload_bytes(chunk.codec, tuple(chunk.shape))


def _open(chunks, slice_map=SLICES.entries):
    return list(assemble_units(chunks, _vet, slice_map))


def _bundle_chunk(payload: bytes, **fields) -> pb.TensorChunk:
    (chunk,) = frame_payload(SliceKey("", 0, 0), payload, BUNDLE_CODEC, "", (), max(1, len(payload)), **fields)
    return chunk


# ----------------------------------------------------------------------------- layout


def test_pack_unpack_round_trip_keeps_order_codecs_and_bytes():
    entries = [
        BundleEntry(3, "int4", "float32", b"\x01\x02\x03"),
        BundleEntry(0, "fp32", "float32", b""),
        BundleEntry(4, "lowrank", "float32", bytes(range(200))),
    ]
    assert unpack_bundle(pack_bundle(entries), num_slices=5) == entries


@pytest.mark.parametrize(
    "mutate, error, fragment",
    [
        (lambda b: b[:3], InvalidFrame, "header needs"),
        (lambda b: b"\x00" + b[1:], InvalidFrame, "bad magic"),
        (lambda b: b[:1] + b"\x02" + b[2:], UnknownCodec, "bundle version 2"),
        (lambda b: b[:2] + struct.pack("<H", 0) + b[4:], InvalidFrame, "no slices"),
        (lambda b: b[:2] + struct.pack("<H", 9) + b[4:], InvalidFrame, "runs past"),
        (lambda b: b[:4] + struct.pack("<I", 5) + b[8:], InvalidFrame, "names slice 5"),
        (lambda b: b[:4] + struct.pack("<I", 1) + b[8:], InvalidFrame, "names a slice twice"),
        (lambda b: b + b"\x00", InvalidFrame, "follow the table"),
        (lambda b: b[:-1], InvalidFrame, "follow the table"),
        (lambda b: b.replace(b"int4", b"int5", 1), UnknownCodec, "int5"),
        (lambda b: b.replace(b"int4", b"\xffnt4", 1), InvalidFrame, "not ASCII"),
    ],
)
def test_malformed_bundles_are_refused(mutate, error, fragment):
    good = pack_bundle([BundleEntry(0, "int4", "float32", b"\x88" * 8), BundleEntry(1, "int4", "float32", b"\x88" * 4)])
    with pytest.raises(error, match=fragment):
        unpack_bundle(mutate(good), num_slices=5)


def test_a_bundle_inside_a_bundle_is_refused():
    inner = BundleEntry(0, BUNDLE_CODEC, "", b"")
    with pytest.raises(InvalidFrame, match="inside a bundle"):
        unpack_bundle(pack_bundle([inner, BundleEntry(1, "int4", "float32", b"")]), num_slices=5)


# ----------------------------------------------------------------------------- framing


def test_small_slices_share_one_chunk_and_large_ones_travel_alone():
    items = _items()
    big = [i for i in items if i.key.name == "big"]  # the assignment splits it into row ranges
    chunk_bytes = 2 * min(len(i.payload) for i in big) - 1  # each piece of "big" is over half a chunk
    assert all(8 * len(i.payload) < chunk_bytes for i in items if i.key.name != "big")
    chunks = list(frame_slices(items, SLICES.index, chunk_bytes))
    kinds = [(c.codec, c.name) for c in chunks]
    assert kinds == [(BUNDLE_CODEC, "")] + [("int4", "big")] * len(big) + [("int4", "tail")], kinds
    assert all(c.raw_bytes <= chunk_bytes for c in chunks)
    units = _open(chunks)
    assert [u.key for u in units] == [i.key for i in items]
    for unit, item in zip(units, items):
        assert bytes(unit.payload) == item.payload
        assert torch.equal(unit.decode(), item.decode())
        assert tuple(unit.meta.shape) == item.shape and unit.meta.codec == item.codec


def test_bundles_split_at_the_chunk_size_and_each_is_one_frame():
    items = [i for i in _items() if i.key.name in ("bias", "norm", "tail")]
    chunk_bytes = 100  # bias and norm take 48 bytes each in a bundle, after its 4-byte header: tail is left
    chunks = list(frame_slices(items, SLICES.index, chunk_bytes))
    assert [c.codec for c in chunks] == [BUNDLE_CODEC, "int4"]
    assert all(c.raw_bytes <= chunk_bytes and c.offset == 0 and c.raw_bytes == c.payload_bytes for c in chunks)
    assert [u.key for u in _open(chunks)] == [i.key for i in items]


def test_chunk_fields_apply_to_every_slice_of_a_bundle():
    items = [i for i in _items() if i.key.name != "big"]
    chunks = list(
        frame_slices(
            items, SLICES.index, 1 << 20, version=7, is_delta=True, base_version=6, contributor="site-b", weight=12.5
        )
    )
    assert len(chunks) == 1
    for unit in _open(chunks):
        meta = unit.meta
        assert (meta.version, meta.is_delta, meta.base_version, meta.contributor, meta.weight) == (
            7,
            True,
            6,
            "site-b",
            12.5,
        )


def test_bundling_is_smaller_than_framing_each_slice():
    items = _items("int4")
    one_by_one = sum(c.ByteSize() for i in items for c in frame_payload(i.key, i.payload, i.codec, i.dtype, i.shape))
    bundled = sum(c.ByteSize() for c in frame_slices(items, SLICES.index, 1 << 20))
    assert bundled < one_by_one


# ----------------------------------------------------------------------------- opening bundles


def test_a_bundle_without_the_slice_map_is_refused():
    chunks = list(frame_slices(_items(), SLICES.index, 1 << 20))
    with pytest.raises(InvalidFrame, match="slice map"):
        _open(chunks, slice_map=())


def test_a_slice_both_bundled_and_sent_alone_is_refused():
    items = _items()
    chunks = list(frame_slices(items, SLICES.index, 1 << 20)) + list(
        frame_payload(items[0].key, items[0].payload, items[0].codec, items[0].dtype, items[0].shape)
    )
    with pytest.raises(InvalidFrame, match="comes twice|already complete"):
        _open(chunks)


@pytest.mark.parametrize("field, value", [("name", "emb"), ("offset", 1), ("shape", [3])])
def test_a_bundle_chunk_must_be_whole_nameless_and_shapeless(field, value):
    chunk = next(iter(frame_slices(_items(), SLICES.index, 1 << 20)))
    if field == "shape":
        chunk.shape[:] = value
    else:
        setattr(chunk, field, value)
    with pytest.raises(InvalidFrame, match="one whole chunk"):
        _open([chunk])


def test_a_payload_over_its_codecs_limit_is_refused():
    key, shape = SLICES.entries[1]  # bias: 16 values
    oversized = BundleEntry(1, "fp32", "float32", b"\x00" * (4 * 16 + 4))
    chunk = _bundle_chunk(pack_bundle([oversized, BundleEntry(2, "fp32", "float32", b"\x00" * 64)]))
    with pytest.raises(InvalidFrame, match="over 64"):
        _open([chunk])


def test_a_corrupt_bundle_frame_is_data_loss():
    chunk = next(iter(frame_slices(_items(), SLICES.index, 1 << 20)))
    frame = bytearray(chunk.zstd_frame)
    frame[len(frame) // 2] ^= 0xFF
    chunk.zstd_frame = bytes(frame)
    with pytest.raises(CorruptFrame):
        _open([chunk])


def test_the_vet_callback_sees_each_bundled_slice():
    seen = []

    def vet(key, chunk):
        seen.append((key, tuple(chunk.shape), chunk.codec))
        return _vet(key, chunk)

    items = [i for i in _items() if i.key.name != "big"]
    list(assemble_units(frame_slices(items, SLICES.index, 1 << 20), vet, SLICES.entries))
    assert seen == [(i.key, i.shape, i.codec) for i in items]


def test_bundle_frames_hold_what_zstd_says():
    chunk = next(iter(frame_slices(_items(), SLICES.index, 1 << 20)))
    raw = zstandard.ZstdDecompressor().decompress(chunk.zstd_frame)
    assert len(raw) == chunk.raw_bytes == chunk.payload_bytes
    assert [e.index for e in unpack_bundle(raw, len(SLICES.entries))] == list(range(len(SLICES.entries)))
