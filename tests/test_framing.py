"""Tests of dilocox.common.wire.framing (chunks, zstd frames), dilocox.common.wire.slice_assembly (a stream
back into slices) and dilocox.common.wire.codecs."""

from __future__ import annotations

import random

import pytest
import torch
import zstandard

from dilocox.common.wire import codecs, framing, slice_assembly
from dilocox.common.wire.errors import CorruptFrame, DilocoxError, InvalidFrame, UnknownCodec, UnknownSlice
from dilocox.common.wire.framing import MAX_CHUNK_BYTES, SliceKey, decompress_chunk, encode_slice
from dilocox.common.wire.slice_assembly import assemble
from dilocox.proto import dilocox_pb2 as pb

KEY = SliceKey("w", 0, 3)


def _generous(_key: SliceKey, chunk: pb.TensorChunk) -> int:
    """A vet callback that allows exactly what the fp32 codec needs for the declared shape."""
    return codecs.max_payload_bytes(chunk.codec, tuple(chunk.shape))


def _chunks(tensor: torch.Tensor, key: SliceKey = KEY, chunk_bytes: int = 64, **kwargs) -> list[pb.TensorChunk]:
    return list(encode_slice(key, tensor, chunk_bytes=chunk_bytes, **kwargs))


def _assemble_one(chunks, vet=_generous) -> torch.Tensor:
    out = list(assemble(chunks, vet))
    assert len(out) == 1
    return out[0][1]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _expect(exc_type: type[DilocoxError], status: str, chunks, vet=_generous, match: str | None = None):
    with pytest.raises(exc_type, match=match) as info:
        list(assemble(chunks, vet))
    assert type(info.value) is exc_type
    assert info.value.status == status
    return info.value


# --------------------------------------------------------------------------- round trips

SHAPES = [(), (1001,), (17, 33), (3, 5, 7), (0,), (3, 0, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("chunk_bytes", [4, 7, 1000, framing.DEFAULT_CHUNK_BYTES])
def test_round_trip_exact(shape, chunk_bytes):
    tensor = _randn(*shape, seed=len(shape) + chunk_bytes)
    chunks = _chunks(tensor, chunk_bytes=chunk_bytes)
    payload = 4 * tensor.numel()
    # Chunk count: ceil(payload / chunk_bytes), at least one even for an empty payload.
    assert len(chunks) == max(1, -(-payload // chunk_bytes))
    assert all(c.raw_bytes <= chunk_bytes for c in chunks)
    assert sum(c.raw_bytes for c in chunks) == payload
    assert all(c.payload_bytes == payload and list(c.shape) == list(shape) for c in chunks)
    out = _assemble_one(chunks)
    assert out.dtype == torch.float32
    assert out.shape == tensor.shape
    assert torch.equal(out, tensor)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffled_chunks_assemble(seed):
    tensor = _randn(37, 11, seed=seed)
    chunks = _chunks(tensor, chunk_bytes=60)  # 1628 bytes → 28 chunks
    assert len(chunks) > 20
    random.Random(seed).shuffle(chunks)
    assert [c.offset for c in chunks] != sorted(c.offset for c in chunks)
    assert torch.equal(_assemble_one(chunks), tensor)


def test_non_contiguous_and_other_dtypes_travel_as_fp32():
    base = _randn(8, 6)
    transposed = base.t()  # not contiguous
    assert not transposed.is_contiguous()
    assert torch.equal(_assemble_one(_chunks(transposed, chunk_bytes=20)), transposed)
    half = base.to(torch.bfloat16)
    out = _assemble_one(_chunks(half))
    assert out.dtype == torch.float32 and torch.equal(out, half.float())


def test_version_and_key_travel_with_the_slice():
    key = SliceKey("layer.weight", 4, 9)
    tensor = _randn(5, 3)
    chunks = _chunks(tensor, key=key, chunk_bytes=16, version=42)
    assert all(framing.key_of(c) == key and c.version == 42 and c.codec == "fp32" for c in chunks)
    [(got_key, got, version)] = list(assemble(chunks, _generous))
    assert (got_key, version) == (key, 42)
    assert torch.equal(got, tensor)
    assert str(key) == "layer.weight[4:9]"


def test_decoded_tensor_does_not_alias_sender_memory():
    tensor = _randn(10)
    chunks = _chunks(tensor, chunk_bytes=8)
    original = tensor.clone()
    out = _assemble_one(chunks)
    tensor.add_(1.0)  # mutate the source after encoding and decoding
    assert torch.equal(out, original)
    out.mul_(2.0)  # and the decoded tensor is writable without touching the source
    assert torch.equal(tensor, original + 1.0)


def test_messages_stay_within_chunk_size_for_a_large_tensor():
    chunk_bytes = 1024 * 1024
    tensor = _randn(2 * 1024 * 1024)  # 8 MiB of incompressible fp32
    chunks = _chunks(tensor, chunk_bytes=chunk_bytes)
    assert len(chunks) == 8
    sizes = [c.ByteSize() for c in chunks]
    assert max(sizes) <= chunk_bytes + 1024
    assert framing.stream_bytes(chunks) == sum(sizes)
    assert torch.equal(_assemble_one(chunks), tensor)


def test_zstd_actually_compresses():
    zeros = torch.zeros(64 * 1024)
    chunks = _chunks(zeros, chunk_bytes=MAX_CHUNK_BYTES)
    assert framing.stream_bytes(chunks) < 4 * zeros.numel() // 50
    assert torch.equal(_assemble_one(chunks), zeros)


def test_frames_carry_checksum_and_content_size():
    chunks = _chunks(_randn(100), chunk_bytes=128)
    for c in chunks:
        params = zstandard.get_frame_parameters(c.zstd_frame)
        assert params.has_checksum
        assert params.content_size == c.raw_bytes


@pytest.mark.parametrize("bad", [0, -1, MAX_CHUNK_BYTES + 1])
def test_encode_refuses_bad_chunk_size(bad):
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(encode_slice(KEY, torch.ones(3), chunk_bytes=bad))


def test_encode_refuses_unknown_codec():
    with pytest.raises(UnknownCodec) as info:
        list(encode_slice(KEY, torch.ones(3), codec="int3"))
    assert info.value.status == "UNIMPLEMENTED"


# --------------------------------------------------------------------------- refusals: frames


def _flip_middle_byte(frame: bytes) -> bytes:
    data = bytearray(frame)
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


def test_corrupt_frame_is_data_loss():
    chunks = _chunks(_randn(300), chunk_bytes=400)
    chunks[1].zstd_frame = _flip_middle_byte(chunks[1].zstd_frame)
    _expect(CorruptFrame, "DATA_LOSS", chunks)


def test_corrupt_compressible_frame_is_data_loss():
    # Compressible data takes zstd's compressed-block path rather than raw blocks.
    chunks = _chunks(torch.arange(2000, dtype=torch.float32) % 7, chunk_bytes=4000)
    assert len(chunks[0].zstd_frame) < chunks[0].raw_bytes // 4
    chunks[0].zstd_frame = _flip_middle_byte(chunks[0].zstd_frame)
    _expect(CorruptFrame, "DATA_LOSS", chunks)


@pytest.mark.parametrize("keep", [3, -1, -4, -50])
def test_truncated_frame_is_data_loss(keep):
    chunks = _chunks(_randn(300), chunk_bytes=400)
    frame = chunks[0].zstd_frame
    chunks[0].zstd_frame = frame[:keep]
    _expect(CorruptFrame, "DATA_LOSS", chunks)


def test_empty_frame_bytes_is_data_loss():
    chunks = _chunks(_randn(10), chunk_bytes=400)
    chunks[0].zstd_frame = b""
    _expect(CorruptFrame, "DATA_LOSS", chunks)


def test_trailing_bytes_after_frame_is_data_loss():
    chunks = _chunks(_randn(100), chunk_bytes=400)
    chunks[0].zstd_frame = chunks[0].zstd_frame + b"\x00extra"
    _expect(CorruptFrame, "DATA_LOSS", chunks)


def test_frame_without_content_size_is_data_loss():
    tensor = _randn(50)
    chunks = _chunks(tensor, chunk_bytes=400)
    raw = memoryview(tensor.numpy()).cast("B").tobytes()
    chunks[0].zstd_frame = zstandard.ZstdCompressor(write_content_size=False, write_checksum=True).compress(raw)
    _expect(CorruptFrame, "DATA_LOSS", chunks)


@pytest.mark.parametrize("delta", [-1, +1])
def test_raw_bytes_header_lying_is_data_loss(delta):
    tensor = _randn(64)
    chunks = _chunks(tensor, chunk_bytes=128)  # two chunks of 128 bytes
    chunks[0].raw_bytes += delta
    if delta > 0:  # keep the chunks from overlapping so the frame check is what fires
        chunks[1].offset += delta
        chunks[1].raw_bytes -= delta
    _expect(CorruptFrame, "DATA_LOSS", chunks)


def test_raw_bytes_above_ceiling_is_invalid():
    chunk = _chunks(_randn(4))[0]
    chunk.raw_bytes = MAX_CHUNK_BYTES + 1
    with pytest.raises(InvalidFrame, match="raw bytes") as info:
        decompress_chunk(chunk)
    assert info.value.status == "INVALID_ARGUMENT"
    # Through assemble too, with a payload (and vet limit) big enough that only the ceiling refuses it.
    chunk.payload_bytes = MAX_CHUNK_BYTES + 4
    chunk.shape[:] = [(MAX_CHUNK_BYTES + 4) // 4]
    _expect(InvalidFrame, "INVALID_ARGUMENT", [chunk], vet=lambda k, c: 2 * MAX_CHUNK_BYTES, match="limit")


def test_negative_raw_bytes_is_invalid():
    chunks = _chunks(_randn(64), chunk_bytes=128)
    chunks[1].raw_bytes = -4
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks)


# --------------------------------------------------------------------------- refusals: tiling


def test_duplicate_chunk_is_an_overlap():
    chunks = _chunks(_randn(64), chunk_bytes=64)
    _expect(InvalidFrame, "INVALID_ARGUMENT", [chunks[0], chunks[1], chunks[1], *chunks[2:]], match="overlap")


def test_partially_overlapping_offsets_are_invalid():
    tensor = _randn(64)  # 256 bytes
    chunks = _chunks(tensor, chunk_bytes=128)
    chunks[1].offset -= 4  # [124, 252) overlaps [0, 128)
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, match="overlap")


def test_missing_chunk_is_a_gap():
    chunks = _chunks(_randn(64), chunk_bytes=64)
    assert len(chunks) == 4
    del chunks[2]
    yielded = []
    with pytest.raises(InvalidFrame, match="incomplete") as info:
        for item in assemble(chunks, _generous):
            yielded.append(item)
    assert info.value.status == "INVALID_ARGUMENT"
    assert yielded == []
    assert str(KEY) in str(info.value)


def test_unfinished_slice_is_reported_even_after_a_complete_one():
    a = _chunks(_randn(8), key=SliceKey("a", 0, 8), chunk_bytes=16)
    b = _chunks(_randn(8), key=SliceKey("b", 0, 8), chunk_bytes=16)
    yielded = []
    with pytest.raises(InvalidFrame, match=r"b\[0:8\]"):
        for key, _tensor, _v in assemble([*a, *b[:-1]], _generous):
            yielded.append(key)
    assert yielded == [SliceKey("a", 0, 8)]


@pytest.mark.parametrize("offset", [256 - 64 + 4, 256, 10_000, -4])
def test_chunk_outside_payload_is_invalid(offset):
    chunks = _chunks(_randn(64), chunk_bytes=64)  # 256-byte payload
    chunks[-1].offset = offset
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks)


def test_empty_chunk_in_nonempty_payload_is_invalid():
    chunks = _chunks(_randn(16), chunk_bytes=32)  # two 32-byte chunks
    empty = pb.TensorChunk()
    empty.CopyFrom(chunks[0])
    empty.raw_bytes = 0
    empty.offset = 32
    empty.zstd_frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"")
    _expect(InvalidFrame, "INVALID_ARGUMENT", [chunks[0], empty], match="empty chunk")


def test_chunk_after_complete_slice_is_invalid():
    chunks = _chunks(_randn(16), chunk_bytes=32)
    _expect(InvalidFrame, "INVALID_ARGUMENT", [*chunks, chunks[0]], match="already complete")


def test_empty_payload_sent_twice_is_invalid():
    chunks = _chunks(torch.empty(0), chunk_bytes=32)
    assert len(chunks) == 1 and chunks[0].raw_bytes == 0
    _expect(InvalidFrame, "INVALID_ARGUMENT", [chunks[0], chunks[0]])


# --------------------------------------------------------------------------- refusals: content


def test_unknown_codec_name_is_unimplemented():
    chunks = _chunks(_randn(16), chunk_bytes=32)
    for c in chunks:
        c.codec = "int3"
    err = _expect(UnknownCodec, "UNIMPLEMENTED", chunks, vet=lambda k, c: 1 << 20)
    assert "int3" in str(err)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_invalid(bad):
    tensor = _randn(40)
    tensor[17] = bad
    chunks = _chunks(tensor, chunk_bytes=64)
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, match="NaN or Inf")


def test_non_finite_scalar_is_invalid():
    _expect(InvalidFrame, "INVALID_ARGUMENT", _chunks(torch.tensor(float("nan"))), match="NaN or Inf")


def test_chunks_disagreeing_on_shape_are_invalid():
    chunks = _chunks(_randn(4, 8), chunk_bytes=32)
    chunks[2].shape[:] = [8, 4]  # same element count, different shape
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, match="disagree")


@pytest.mark.parametrize("field, value", [("dtype", "float16"), ("payload_bytes", 1024), ("codec", "int8")])
def test_chunks_disagreeing_on_header_fields_are_invalid(field, value):
    chunks = _chunks(_randn(4, 8), chunk_bytes=32)
    setattr(chunks[1], field, value)
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, vet=lambda k, c: 1 << 20, match="disagree")


def test_wrong_dtype_for_codec_is_invalid():
    chunks = _chunks(_randn(8), chunk_bytes=64)
    for c in chunks:
        c.dtype = "float16"
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, match="float16")


def test_shape_not_matching_payload_is_invalid():
    chunks = _chunks(_randn(8), chunk_bytes=64)
    for c in chunks:
        c.shape[:] = [9]
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, vet=lambda k, c: 1 << 20, match="does not hold")


def test_negative_dimension_is_invalid():
    chunks = _chunks(_randn(8), chunk_bytes=64)
    for c in chunks:
        c.shape[:] = [-8]
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, vet=lambda k, c: 1 << 20, match="negative")


def test_payload_above_vet_limit_is_invalid():
    chunks = _chunks(_randn(64), chunk_bytes=64)
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, vet=lambda k, c: 255, match="outside")
    # Exactly at the limit is fine.
    assert torch.equal(_assemble_one(chunks, vet=lambda k, c: 256), _randn(64))


def test_huge_declared_payload_is_refused_before_allocation():
    chunks = _chunks(_randn(4))
    chunks[0].payload_bytes = 1 << 50  # allocating this would fail loudly
    _expect(InvalidFrame, "INVALID_ARGUMENT", chunks, match="outside")


# --------------------------------------------------------------------------- assemble: streaming and vetting


def test_assemble_yields_each_slice_as_soon_as_its_last_chunk_arrives():
    keys = [SliceKey("a", 0, 4), SliceKey("b", 0, 2), SliceKey("c", 4, 8)]
    tensors = {keys[0]: _randn(4, 5, seed=1), keys[1]: _randn(2, 5, seed=2), keys[2]: _randn(4, 5, seed=3)}
    per_key = {k: _chunks(t, key=k, chunk_bytes=16) for k, t in tensors.items()}
    # Interleave: round-robin over the slices, so they finish at different points in the stream.
    stream = []
    queues = {k: list(v) for k, v in per_key.items()}
    while any(queues.values()):
        for k in keys:
            if queues[k]:
                stream.append(queues[k].pop(0))
    last_index = {framing.key_of(c): i for i, c in enumerate(stream)}

    consumed = 0

    def feed():
        nonlocal consumed
        for c in stream:
            consumed += 1
            yield c

    order = []
    for key, tensor, _version in assemble(feed(), _generous):
        # Yielded right after its last chunk was pulled, not later.
        assert consumed == last_index[key] + 1
        assert torch.equal(tensor, tensors[key])
        order.append(key)
    assert order == sorted(keys, key=lambda k: last_index[k])
    assert order[0] == SliceKey("b", 0, 2)  # the smallest slice finishes first


def test_vet_is_called_once_per_slice_with_its_first_chunk():
    keys = [SliceKey("a", 0, 4), SliceKey("b", 0, 4)]
    per_key = {k: _chunks(_randn(4, 4, seed=i), key=k, chunk_bytes=8) for i, k in enumerate(keys)}
    stream = [c for pair in zip(*per_key.values()) for c in pair]
    calls = []

    def vet(key, chunk):
        calls.append((key, chunk.offset))
        return _generous(key, chunk)

    assert [k for k, _, _ in assemble(stream, vet)] == keys
    assert calls == [(keys[0], 0), (keys[1], 0)]


def test_vet_raising_stops_the_stream_before_allocation(monkeypatch):
    allocated = []
    real_init = slice_assembly.SliceAssembler.__init__

    def spy_init(self, first, limit):
        allocated.append(framing.key_of(first))
        real_init(self, first, limit)

    monkeypatch.setattr(slice_assembly.SliceAssembler, "__init__", spy_init)
    good = _chunks(_randn(8, seed=1), key=SliceKey("ok", 0, 8), chunk_bytes=16)
    bad = _chunks(_randn(8, seed=2), key=SliceKey("stranger", 0, 8), chunk_bytes=16)
    pulled = 0

    def feed():
        nonlocal pulled
        for c in [*good, *bad, *good]:
            pulled += 1
            yield c

    def vet(key, chunk):
        if key.name == "stranger":
            raise UnknownSlice(f"this shard does not own {key}")
        return _generous(key, chunk)

    yielded = []
    with pytest.raises(UnknownSlice) as info:
        for key, _t, _v in assemble(feed(), vet):
            yielded.append(key)
    assert info.value.status == "NOT_FOUND"
    assert yielded == [SliceKey("ok", 0, 8)]
    assert pulled == len(good) + 1  # stopped at the first chunk of the refused slice
    assert allocated == [SliceKey("ok", 0, 8)]  # no buffer for the refused slice


# --------------------------------------------------------------------------- codecs directly


def test_codec_registry_and_limits():
    assert "fp32" in codecs.CODECS
    assert codecs.max_payload_bytes("fp32", (3, 5)) == 60
    assert codecs.max_payload_bytes("fp32", ()) == 4
    with pytest.raises(UnknownCodec):
        codecs.max_payload_bytes("nope", (3,))
    with pytest.raises(UnknownCodec):
        codecs.check_known("")


def test_codec_encode_decode_round_trip():
    tensor = _randn(3, 4)
    payload, dtype = codecs.encode("fp32", tensor)
    assert dtype == "float32" and len(payload) == 48
    out = codecs.decode("fp32", bytearray(payload), dtype, (3, 4))
    assert torch.equal(out, tensor)
    with pytest.raises(InvalidFrame):
        codecs.decode("fp32", bytearray(payload), dtype, (4, 4))
