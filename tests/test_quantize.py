"""Tests of dilocox.common.wire.quantize (blockwise int8/int4) and the lossy codecs it backs in common.codecs."""

from __future__ import annotations

import math
import struct

import pytest
import torch
import zstandard

from dilocox.common.wire import codecs
from dilocox.common.wire.errors import InvalidFrame, UnknownCodec
from dilocox.common.wire.framing import SliceKey, decompress_chunk, encode_slice
from dilocox.common.wire.quantize import (
    HEADER_BYTES,
    QUANT_VERSION,
    decode_quantized,
    encode_quantized,
    quantized_nbytes,
    relative_error_bound,
)
from dilocox.common.wire.slice_assembly import assemble
from dilocox.proto import dilocox_pb2 as pb

QMAX = {8: 127, 4: 7}
KEY = SliceKey("w", 0, 17)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """absmax of each element's block, per element (reference, by padding)."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    padded = torch.cat([flat, flat.new_zeros(-n % block)]).view(-1, block)
    return padded.abs().amax(dim=1).repeat_interleave(block)[:n]


def _assert_within_bound(x: torch.Tensor, y: torch.Tensor, bits: int, block: int) -> None:
    flat = x.reshape(-1).to(torch.float32)
    err = (y.reshape(-1) - flat).abs()
    limit = relative_error_bound(bits) * _block_absmax(flat, block) * (1 + 1e-5) + 1e-30
    assert bool((err <= limit).all()), f"max excess {(err - limit).max().item()}"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


# --------------------------------------------------------------------------- round trips


def test_bounds_values():
    assert relative_error_bound(8) == pytest.approx(0.5 / 127)
    assert relative_error_bound(4) == pytest.approx(0.5 / 7)
    with pytest.raises(ValueError):
        relative_error_bound(5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [1, 7, 64, 128, 4096])
def test_round_trip_within_bound_normal(bits, block):
    x = _randn(3001, seed=bits * block)
    payload = encode_quantized(x, bits, block)
    y, end = decode_quantized(payload)
    assert end == len(payload) == quantized_nbytes(x.numel(), bits, block)
    assert y.dtype == torch.float32 and y.shape == (3001,)
    _assert_within_bound(x, y, bits, block)
    if block > 1:  # the bound is not vacuous: the error is of that order on random data
        assert (y - x).abs().max() > 0.2 * relative_error_bound(bits) * x.abs().max()


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_within_bound_mixed_magnitudes(bits):
    block = 32
    scales = torch.tensor([10.0**k for k in range(-30, 31, 3)]).repeat_interleave(block)
    x = _randn(scales.numel(), seed=bits) * scales
    y, _ = decode_quantized(encode_quantized(x, bits, block))
    _assert_within_bound(x, y, bits, block)
    # Each block's error scales with its own magnitude: tiny blocks keep tiny errors.
    rel = (y - x).abs().view(-1, block).amax(1) / x.abs().view(-1, block).amax(1)
    assert bool((rel <= relative_error_bound(bits) * (1 + 1e-5)).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_values_on_the_grid_are_exact(bits):
    qmax, block = QMAX[bits], 16
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-qmax, qmax + 1, (10, block), generator=g).to(torch.float32)
    codes[:, 0] = qmax  # each block reaches ±qmax so the scale is exactly the step
    codes[::2, 0] = -qmax
    steps = torch.tensor([2.0**k for k in range(-10, 10, 2)])[:, None]
    x = (codes * steps).reshape(-1)
    y, _ = decode_quantized(encode_quantized(x, bits, block))
    assert torch.equal(y, x)


@pytest.mark.parametrize("n", [1, 2, 3, 127, 128, 129, 1001])
def test_int4_odd_lengths(n):
    x = _randn(n, seed=n)
    payload = encode_quantized(x, 4, 128)
    assert len(payload) == HEADER_BYTES + 4 * math.ceil(n / 128) + (n + 1) // 2
    y, end = decode_quantized(payload)
    assert end == len(payload) and y.shape == (n,)
    _assert_within_bound(x, y, 4, 128)


def test_layout_of_header_scales_and_nibbles():
    x = torch.tensor([7.0, -7.0, 0.0])  # absmax 7 → scale 1 → codes 7, -7, 0 → nibbles 15, 1, 8
    payload = encode_quantized(x, 4, 128)
    magic, version, bits, block, numel = struct.unpack_from("<BBBIQ", payload)
    assert (magic, version, bits, block, numel) == (0xD7, QUANT_VERSION, 4, 128, 3)
    assert struct.unpack_from("<f", payload, HEADER_BYTES) == (1.0,)
    assert payload[HEADER_BYTES + 4 :] == bytes([0x1F, 0x08])  # low nibble = even index, last high nibble empty
    p8 = encode_quantized(torch.tensor([254.0, -127.0, 1.0]), 8, 2)
    assert struct.unpack_from("<2f", p8, HEADER_BYTES) == struct.unpack("<2f", struct.pack("<2f", 2.0, 1 / 127))
    assert p8[HEADER_BYTES + 8 :] == struct.pack("<3b", 127, -64, 127)  # -63.5 rounds to even


@pytest.mark.parametrize("bits", [8, 4])
def test_empty_and_zero_block(bits):
    payload = encode_quantized(torch.empty(0), bits)
    assert len(payload) == HEADER_BYTES == quantized_nbytes(0, bits)
    y, end = decode_quantized(payload)
    assert y.shape == (0,) and y.dtype == torch.float32 and end == HEADER_BYTES
    x = torch.cat([torch.zeros(128), _randn(100)])
    payload = encode_quantized(x, bits, 128)
    assert struct.unpack_from("<f", payload, HEADER_BYTES) == (0.0,)
    y, _ = decode_quantized(payload)
    assert torch.equal(y[:128], torch.zeros(128))
    _assert_within_bound(x, y, bits, 128)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, block", [(0, 1), (1, 1), (5, 2), (1000, 128), (1001, 128), (3, 2**32 - 1)])
def test_nbytes_matches_encoding(bits, n, block):
    assert quantized_nbytes(n, bits, block) == len(encode_quantized(_randn(n), bits, block))


def test_any_shape_and_dtype_flattens():
    x = _randn(4, 5, 6).to(torch.bfloat16)
    y, _ = decode_quantized(encode_quantized(x, 8, 8))
    assert y.shape == (120,)
    _assert_within_bound(x.to(torch.float32), y, 8, 8)


def test_concatenated_payloads_decode_with_offsets():
    a, b = _randn(300, seed=1), _randn(77, seed=2)
    pa, pb_ = encode_quantized(a, 8, 64), encode_quantized(b, 4, 16)
    buffer = bytearray(b"xyz") + pa + pb_
    ya, mid = decode_quantized(buffer, 3)
    yb, end = decode_quantized(memoryview(buffer), mid)
    assert (mid, end) == (3 + len(pa), len(buffer))
    assert _bits_equal(ya, decode_quantized(pa)[0]) and _bits_equal(yb, decode_quantized(pb_)[0])
    _assert_within_bound(a, ya, 8, 64)
    _assert_within_bound(b, yb, 4, 16)


@pytest.mark.parametrize("bits", [8, 4])
def test_encode_and_decode_are_deterministic(bits):
    x = _randn(5000, seed=7) * 3
    payload = encode_quantized(x, bits)
    assert payload == encode_quantized(x.clone(), bits)
    y1, _ = decode_quantized(payload)
    y2, _ = decode_quantized(bytearray(payload))
    y3, _ = decode_quantized(memoryview(payload))
    assert _bits_equal(y1, y2) and _bits_equal(y1, y3)


def test_compression_ratio():
    n = 1 << 20
    int4 = len(encode_quantized(_randn(n), 4, 128))
    assert int4 == quantized_nbytes(n, 4, 128)
    assert 4 * n / int4 >= 7.0
    assert 4 * n / quantized_nbytes(n, 8, 128) >= 3.8


# --------------------------------------------------------------------------- refusals


def test_encode_refuses_bad_arguments():
    x = _randn(10)
    for bits in (5, 16, 0, True):
        with pytest.raises(ValueError):
            encode_quantized(x, bits)
    for block in (0, -1, 2**32):
        with pytest.raises(ValueError):
            encode_quantized(x, 8, block)
    with pytest.raises(ValueError):
        quantized_nbytes(10, 5)
    with pytest.raises(ValueError):
        encode_quantized(torch.tensor([1.0, float("nan")]), 8)


def _patched(payload: bytes, pos: int, fmt: str, value) -> bytearray:
    out = bytearray(payload)
    struct.pack_into(fmt, out, pos, value)
    return out


def _expect(exc_type, buffer, match=None):
    with pytest.raises(exc_type, match=match) as info:
        decode_quantized(buffer)
    assert type(info.value) is exc_type


GOOD4 = encode_quantized(_randn(301, seed=3), 4, 64)
GOOD8 = encode_quantized(_randn(301, seed=3), 8, 64)


def test_refuses_bad_header_fields():
    _expect(InvalidFrame, _patched(GOOD4, 0, "<B", 0xD6), "magic")
    _expect(UnknownCodec, _patched(GOOD4, 1, "<B", QUANT_VERSION + 1), "version")
    _expect(InvalidFrame, _patched(GOOD4, 2, "<B", 5), "bits")
    _expect(InvalidFrame, _patched(GOOD4, 3, "<I", 0), "block")


def test_refuses_truncated_buffers():
    for cut in (0, 1, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 5, len(GOOD4) - 1):
        _expect(InvalidFrame, GOOD4[:cut])
    with pytest.raises(InvalidFrame):
        decode_quantized(GOOD4, 1)
    with pytest.raises(InvalidFrame):
        decode_quantized(GOOD4, len(GOOD4) + 10)


def test_refuses_huge_declared_sizes_without_allocating():
    _expect(InvalidFrame, _patched(GOOD8, 7, "<Q", 2**63), "declares")
    _expect(InvalidFrame, _patched(GOOD8, 3, "<I", 1), "declares")  # 301 scales do not fit
    _expect(InvalidFrame, _patched(GOOD4, 2, "<B", 8), "declares")  # int8 codes are twice as long


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_refuses_bad_scales(bad):
    _expect(InvalidFrame, _patched(GOOD4, HEADER_BYTES + 4, "<f", bad), "scale")


def test_refuses_codes_outside_range_and_overflow():
    _expect(InvalidFrame, _patched(GOOD8, len(GOOD8) - 1, "<b", -128), "-128")
    _expect(InvalidFrame, _patched(GOOD4, len(GOOD4) - 2, "<B", 0x80), "-8")  # low nibble 0
    odd = encode_quantized(torch.ones(3), 4)
    _expect(InvalidFrame, _patched(odd, len(odd) - 1, "<B", 0x1F), "padding")
    huge = encode_quantized(torch.full((4,), 127.0), 8)
    _expect(InvalidFrame, _patched(huge, HEADER_BYTES, "<f", 3e38), "range")


# --------------------------------------------------------------------------- codecs and framing

TOLERANCE = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _vet(_key, chunk: pb.TensorChunk) -> int:
    return codecs.max_payload_bytes(chunk.codec, tuple(chunk.shape))


def _through_framing(tensor: torch.Tensor, codec: str, chunk_bytes: int = 256) -> torch.Tensor:
    out = list(assemble(encode_slice(KEY, tensor, codec=codec, chunk_bytes=chunk_bytes), _vet))
    assert len(out) == 1
    return out[0][1]


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", [(17, 33), (1001,), (), (0,), (3, 0, 2)])
def test_end_to_end_through_framing(codec, shape):
    x = _randn(*shape, seed=len(shape)) * 5
    y = _through_framing(x, codec)
    assert y.shape == x.shape and y.dtype == torch.float32
    if codec in TOLERANCE:
        assert bool(((y - x).abs() <= TOLERANCE[codec] * x.abs() + 1e-7).all())
    else:
        _assert_within_bound(x, y, 8 if codec == "int8" else 4, 128)
    assert _bits_equal(y, _through_framing(x, codec, chunk_bytes=7))  # same bytes, same tensor


def test_codec_registry_and_limits():
    assert {"fp32", "fp16", "bf16", "int8", "int4"} <= set(codecs.CODECS)
    assert codecs.max_payload_bytes("fp16", (3, 5)) == 30 == codecs.max_payload_bytes("bf16", (3, 5))
    assert codecs.max_payload_bytes("int8", (3, 5)) == quantized_nbytes(15, 8, 1)
    assert codecs.max_payload_bytes("int4", ()) == quantized_nbytes(1, 4, 1)
    assert codecs.encode("int4", torch.ones(2))[1] == "int4"
    assert codecs.encode("bf16", torch.ones(2))[1] == "bfloat16"


@pytest.mark.parametrize("bits, name", [(8, "int8"), (4, "int4")])
def test_int_codecs_accept_any_block_and_check_shape(bits, name):
    x = _randn(6, 50)
    for block in (1, 64, 1000):
        payload = encode_quantized(x, bits, block)
        assert len(payload) <= codecs.max_payload_bytes(name, (6, 50))
        y = codecs.decode(name, bytearray(payload), name, (6, 50))
        assert y.shape == (6, 50)
        _assert_within_bound(x, y, bits, block)
    payload = encode_quantized(x, bits)
    with pytest.raises(InvalidFrame, match="needs"):
        codecs.decode(name, bytearray(payload), name, (6, 49))
    with pytest.raises(InvalidFrame, match="trailing"):
        codecs.decode(name, bytearray(payload) + b"\0", name, (6, 50))
    with pytest.raises(InvalidFrame):
        codecs.decode(name, bytearray(payload), "float32", (6, 50))


@pytest.mark.parametrize("name, dtype", [("fp16", "float16"), ("bf16", "bfloat16")])
def test_half_codecs_refuse_bad_payloads(name, dtype):
    payload, got = codecs.encode(name, _randn(8))
    assert got == dtype and len(payload) == 16
    with pytest.raises(InvalidFrame, match="does not hold"):
        codecs.decode(name, bytearray(payload)[:-1], dtype, (8,))
    with pytest.raises(InvalidFrame, match="carries"):
        codecs.decode(name, bytearray(payload), "float32", (8,))
    inf_payload, _ = codecs.encode(name, torch.tensor([1.0, float("inf")]))
    with pytest.raises(InvalidFrame, match="NaN or Inf"):
        codecs.decode(name, bytearray(inf_payload), dtype, (2,))


def test_fp16_saturates_finite_overflow():
    payload, _ = codecs.encode("fp16", torch.tensor([1e6, -1e6, 1.0]))
    assert codecs.decode("fp16", bytearray(payload), "float16", (3,)).tolist() == [65504.0, -65504.0, 1.0]


def _rewrite_first_chunk(chunks: list[pb.TensorChunk], pos: int, value: int) -> None:
    raw = bytearray(decompress_chunk(chunks[0]))
    raw[pos] = value
    chunks[0].zstd_frame = zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(bytes(raw))


@pytest.mark.parametrize(
    "pos, value, exc", [(2, 5, InvalidFrame), (2, 8, InvalidFrame), (0, 0, InvalidFrame), (1, 9, UnknownCodec)]
)
def test_corrupted_int4_header_is_refused_through_framing(pos, value, exc):
    chunks = list(encode_slice(KEY, _randn(17, 33), codec="int4", chunk_bytes=64))
    _rewrite_first_chunk(chunks, pos, value)
    with pytest.raises(exc) as info:
        list(assemble(chunks, _vet))
    assert type(info.value) is exc
