"""Fuzzing the wire decoders: no input may crash a shard.

Whatever bytes or chunk fields a client sends, the frame decoder (`decompress_chunk`, `assemble_units`)
and the codec decoders (`codecs.decode`, `decode_quantized`) either decode or raise one of the project's
own `DilocoxError`s, which the servicer turns into a precise status. Anything else (IndexError,
ValueError, struct/zstd errors, MemoryError) would escape as UNKNOWN, or worse take the process down.
Valid frames must round-trip. Bounded for CI: derandomised, a few hundred examples each, no deadline.

The last test sends a few hundred mutated pushes through real gRPC and checks that each gets exactly the
status and message the decoder gives locally, and that the shard's state never moves.
"""

from __future__ import annotations

import random
import re
import struct
import tracemalloc

import grpc
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_bad_input import (
    as_messages,
    assert_round_completes,
    assert_unchanged,
    declared,
    full_state,
    good_messages,
    header,
    open_round_scene,
    reference_round_1,  # noqa: F401 - a fixture, used by name
)

from dilocox.common.wire import codecs
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.errors import DilocoxError
from dilocox.common.wire.framing import MAX_CHUNK_BYTES, SliceKey, decompress_chunk, encode_slice
from dilocox.common.wire.lowrank import as_matrix_shape
from dilocox.common.wire.quantize import decode_quantized
from dilocox.common.wire.slice_assembly import assemble_units
from dilocox.proto import dilocox_pb2 as pb
from dilocox.server.shard import Shard

FUZZ = settings(
    derandomize=True, database=None, max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
CODEC_NAMES = sorted(codecs.CODECS)
CODEC_DTYPES = {name: codecs.encode(name, torch.ones(2, 2))[1] for name in CODEC_NAMES}
DTYPES = ["float32", "float16", "bfloat16", "int8", "int4", "float64", ""]
INTERESTING = [0, 1, -1, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1, -(2**63)]


def decodes_or_refuses(decode, *args):
    """Run a decoder; a DilocoxError is a refusal (fine), any other exception fails the test.

    The outcome is a Hypothesis event, so `--hypothesis-show-statistics` shows which refusals the
    inputs reach (a fuzzer stuck on one shallow error would test little)."""
    try:
        result = decode(*args)
    except DilocoxError as error:
        event(f"refused: {type(error).__name__}: {re.sub(r'[^ ]*[0-9][^ ]*', '#', str(error))[:48]}")
        return None
    event("decoded")
    return result


# ----------------------------------------------------------------------------- mutations


def _interesting_int(rng: random.Random, current: int) -> int:
    """Edges, neighbours of the true value, and noise; clamped to int64 (what the proto fields hold)."""
    value = rng.choice(
        [*INTERESTING, current + 1, current - 1, current + 8, current * 2, rng.randrange(-(2**63), 2**63)]
    )
    return max(-(2**63), min(2**63 - 1, value))


def mutate_bytes(rng: random.Random, blob: bytes, other: bytes) -> bytes:
    """One structural mutation of a byte string: flip, truncate, extend, splice with `other`, overwrite."""
    data = bytearray(blob)
    kind = rng.choice(["flip", "truncate", "extend", "splice", "overwrite", "replace"])
    if kind == "flip" and data:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[rng.randrange(len(data) + 1) :]
    elif kind == "extend":
        data[rng.randrange(len(data) + 1) : 0] = rng.randbytes(rng.randrange(1, 9))
    elif kind == "splice":
        data = data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1) :]
    elif kind == "overwrite" and data:
        at = rng.randrange(min(len(data), 24))  # headers live up front
        data[at : at + 4] = rng.randbytes(4)
    elif kind == "replace":
        data = bytearray(rng.choice([b"", ZSTD_MAGIC]) + rng.randbytes(rng.randrange(64)))
    return bytes(data)


def _mutate_field(rng: random.Random, chunk: pb.TensorChunk) -> None:
    field = rng.choice(
        ["offset", "raw_bytes", "payload_bytes", "row_start", "row_stop", "codec", "dtype", "shape", "name"]
    )
    if field == "codec":
        chunk.codec = rng.choice([*CODEC_NAMES, "fp64", "zstd", ""])
    elif field == "dtype":
        chunk.dtype = rng.choice(DTYPES)
    elif field == "shape":
        shape = list(chunk.shape)
        if shape and rng.random() < 0.5:
            shape[rng.randrange(len(shape))] = _interesting_int(rng, shape[0])
        else:
            shape = shape + [rng.choice([0, 1, 2, -1])] if rng.random() < 0.5 else shape[:-1]
        chunk.shape[:] = shape
    elif field == "name":
        chunk.name = rng.choice(["", "tok_emb", "w", "b", "gain", "x" * 300])
    else:
        setattr(chunk, field, _interesting_int(rng, getattr(chunk, field)))


def mutate_stream(rng: random.Random, chunks: list[pb.TensorChunk]) -> list[pb.TensorChunk]:
    """A copy of a valid chunk stream with 1–3 mutations: frame bytes, header fields, or chunk order/count."""
    out = [pb.TensorChunk() for _ in chunks]
    for copy, chunk in zip(out, chunks):
        copy.CopyFrom(chunk)
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(out)
        kind = rng.choice(["frame", "frame", "field", "duplicate", "drop", "swap"])
        if kind == "frame":
            target.zstd_frame = mutate_bytes(rng, target.zstd_frame, rng.choice(out).zstd_frame)
        elif kind == "field":
            _mutate_field(rng, target)
        elif kind == "duplicate":
            out.insert(rng.randrange(len(out) + 1), target)
        elif kind == "drop" and len(out) > 1:
            out.remove(target)
        elif kind == "swap":
            i, j = rng.randrange(len(out)), rng.randrange(len(out))
            out[i], out[j] = out[j], out[i]
    return out


# ----------------------------------------------------------------------------- zstd frames


def _chunk(frame: bytes, raw_bytes: int) -> pb.TensorChunk:
    return pb.TensorChunk(
        name="w",
        row_start=0,
        row_stop=4,
        codec="fp32",
        dtype="float32",
        shape=[4],
        payload_bytes=max(raw_bytes, 0),
        raw_bytes=raw_bytes,
        zstd_frame=frame,
    )


def _frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(data)


@FUZZ
@given(
    frame=st.one_of(st.binary(max_size=512), st.binary(max_size=512).map(lambda b: ZSTD_MAGIC + b)),
    raw_bytes=st.one_of(st.integers(-8, 1024), st.sampled_from(INTERESTING)),
)
def test_arbitrary_bytes_never_crash_the_frame_decoder(frame, raw_bytes):
    raw = decodes_or_refuses(decompress_chunk, _chunk(frame, raw_bytes))
    assert raw is None or len(raw) == raw_bytes


@FUZZ
@given(data=st.binary(max_size=2048), compressible=st.booleans(), rng=st.randoms(use_true_random=False))
def test_mutated_frames_are_refused_or_decode_to_the_original(data, compressible, rng):
    """A flip may hit a bit zstd ignores (the frame header's unused bit); then the bytes must be intact."""
    original = bytes(len(data)) if compressible else data
    spliced_in = rng.randbytes(64)  # a splice may leave the other frame whole: then its bytes come out
    mutant = mutate_bytes(rng, _frame(original), _frame(spliced_in))
    raw = decodes_or_refuses(decompress_chunk, _chunk(mutant, len(original)))
    assert raw in (None, original, spliced_in)


def _frame_claiming(size: int, body: bytes) -> bytes:
    """A single-segment zstd frame whose header claims `size` content bytes, holding one raw block."""
    descriptor = 0b1110_0100  # 8-byte content size, single segment, content checksum
    block = ((len(body) << 3) | 1).to_bytes(3, "little")  # last block, raw
    return ZSTD_MAGIC + bytes([descriptor]) + size.to_bytes(8, "little") + block + body + b"\0\0\0\0"


@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(
    claimed=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + 1, 2**40])),
    honest_header=st.booleans(),
    body=st.binary(max_size=64),
)
def test_a_frame_claiming_a_huge_size_is_refused_before_allocating(claimed, honest_header, body):
    """Neither the frame's content size nor the chunk's raw_bytes may make the decoder allocate past the cap."""
    raw_bytes = min(claimed, 2**63 - 1) if honest_header else len(body)
    tracemalloc.start()
    try:
        raw = decodes_or_refuses(decompress_chunk, _chunk(_frame_claiming(claimed, body), raw_bytes))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MAX_CHUNK_BYTES + (1 << 20)
    assert raw is None or raw == body


# ----------------------------------------------------------------------------- chunk streams


def _vetting_shard() -> Shard:
    """A shard core (2-D, 1-D and scalar parameters) whose `vet_slice` vets streams as the server does."""
    params = [("w", (64, 16)), ("b", (48,)), ("s", ())]
    shard = Shard(0, 1, "fuzz")
    shard.join("fuzz", "a", model_digest(params), params)
    return shard


VETTER = _vetting_shard()
OWNED = sorted(VETTER.owned.values(), key=lambda s: s.key)  # the assignment cuts even one shard's share into slices


def vet(key: SliceKey, chunk: pb.TensorChunk) -> int:
    return VETTER.vet_slice(key, chunk.codec, tuple(chunk.shape))


def _valid_stream(rng: random.Random) -> list[pb.TensorChunk]:
    owned = rng.choice(OWNED)
    shape = owned.slice_shape
    codec = rng.choice([c for c in CODEC_NAMES if c != "lowrank" or len(shape) == 2])
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    return list(encode_slice(owned.key, tensor, codec, chunk_bytes=rng.choice([1, 7, 64, 256, 4096])))


def _check_units(units) -> None:
    for unit in units:
        decoded = unit.decode()  # whatever passed the vet decodes, finite and of the frame's shape
        assert tuple(decoded.shape) == tuple(unit.meta.shape)
        assert bool(torch.isfinite(decoded).all())


@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_mutated_chunk_streams_are_refused_or_decode_finite(rng):
    chunks = mutate_stream(rng, _valid_stream(rng))
    _check_units(decodes_or_refuses(lambda: list(assemble_units(chunks, vet))) or [])


_any_int = st.one_of(st.integers(-4, 2048), st.sampled_from(INTERESTING))


@st.composite
def _random_chunk(draw) -> pb.TensorChunk:
    """Fields drawn near a real slice (so that vetting passes and the assembler is reached) or anywhere."""
    owned = draw(st.sampled_from(OWNED))

    def near(truth, anything):
        return truth if draw(st.integers(0, 4)) else draw(anything)

    content = draw(st.binary(max_size=256))
    codec = draw(st.sampled_from([*CODEC_NAMES, "fp64"]))
    key = (
        owned.key
        if draw(st.integers(0, 9))
        else SliceKey(draw(st.sampled_from(["", "zz", "w"])), draw(_any_int), draw(_any_int))
    )
    return pb.TensorChunk(
        name=key.name,
        row_start=key.row_start,
        row_stop=key.row_stop,
        codec=codec,
        dtype=near(CODEC_DTYPES.get(codec, ""), st.sampled_from(DTYPES)),
        shape=near(list(owned.slice_shape), st.lists(st.integers(-1, 8), max_size=3)),
        payload_bytes=near(codecs.max_payload_bytes("fp32", owned.slice_shape), _any_int),
        offset=near(0, _any_int),
        raw_bytes=near(len(content), _any_int),
        zstd_frame=near(_frame(content), st.binary(max_size=64)),
    )


@FUZZ
@given(chunks=st.lists(_random_chunk(), max_size=6))
def test_random_chunk_streams_never_crash_the_assembler(chunks):
    _check_units(decodes_or_refuses(lambda: list(assemble_units(chunks, vet))) or [])


@FUZZ
@given(
    rows=st.integers(0, 6),
    cols=st.integers(1, 6),
    codec=st.sampled_from(CODEC_NAMES),
    chunk_bytes=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
    rng=st.randoms(use_true_random=False),
)
def test_valid_frames_round_trip_in_any_order(rows, cols, codec, chunk_bytes, seed, rng):
    """Framing is lossless: shuffled chunks give back the exact payload, and fp32 the exact tensor."""
    rows = max(rows, 1) if codec == "lowrank" else rows
    tensor = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    payload, dtype = codecs.encode(codec, tensor)
    chunks = list(encode_slice(SliceKey("w", 0, rows), tensor, codec, chunk_bytes=chunk_bytes))
    rng.shuffle(chunks)
    (unit,) = assemble_units(chunks, lambda key, chunk: codecs.max_payload_bytes(chunk.codec, (rows, cols)))
    assert bytes(unit.payload) == bytes(payload)
    expected = tensor if codec == "fp32" else codecs.decode(codec, bytearray(payload), dtype, (rows, cols))
    assert torch.equal(unit.decode(), expected)


# ----------------------------------------------------------------------------- codec payloads


_SHAPES = st.lists(st.integers(0, 6), max_size=3).map(tuple)


@FUZZ
@given(codec=st.sampled_from(CODEC_NAMES), shape=_SHAPES, buffer=st.binary(max_size=600))
def test_arbitrary_payloads_never_crash_a_codec(codec, shape, buffer):
    dtype = CODEC_DTYPES[codec]
    tensor = decodes_or_refuses(codecs.decode, codec, bytearray(buffer), dtype, shape)
    assert tensor is None or (tuple(tensor.shape) == shape and bool(torch.isfinite(tensor).all()))


def _random_header(rng: random.Random, codec: str, shape: tuple[int, ...]) -> bytes:
    """Header fields drawn from plausible and hostile values (quantised: `<BBBIQ`, low-rank: `<BBBxIII`)."""

    def byte(good):
        return rng.choice([good, rng.randrange(256)])

    if codec == "lowrank":
        rows, cols = as_matrix_shape(shape)
        dims = [rng.choice([d, rng.randrange(2**32)]) for d in (rows, cols, min(rows, cols))]
        return struct.pack("<BBBxIII", byte(0xC5), byte(1), rng.choice([32, 8, 4, rng.randrange(256)]), *dims)
    block = rng.choice([1, 2, 128, 2**32 - 1, rng.randrange(2**32)])
    return struct.pack(
        "<BBBIQ",
        byte(0xD7),
        byte(1),
        rng.choice([8, 4, rng.randrange(256)]),
        block,
        rng.choice([n for n in INTERESTING if n >= 0]),
    )


@FUZZ
@given(
    codec=st.sampled_from(["int8", "int4", "lowrank", "fp16", "fp32"]),
    shape=st.lists(st.integers(1, 6), min_size=2, max_size=3).map(tuple),
    seed=st.integers(0, 2**31 - 1),
    rng=st.randoms(use_true_random=False),
)
def test_mutated_codec_payloads_are_refused_or_decode_finite(codec, shape, seed, rng):
    payload, dtype = codecs.encode(codec, torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    payload = bytes(payload)
    if codec in ("int8", "int4", "lowrank") and rng.random() < 0.4:
        head = _random_header(rng, codec, shape)
        mutant = head + payload[len(head) :]
    else:
        mutant = mutate_bytes(rng, payload, payload[::-1])
    tensor = decodes_or_refuses(codecs.decode, codec, bytearray(mutant), dtype, shape)
    assert tensor is None or (tuple(tensor.shape) == shape and bool(torch.isfinite(tensor).all()))


_quantised_headers = st.builds(
    struct.pack,
    st.just("<BBBIQ"),
    st.sampled_from([0xD7, 0xD7, 0xD7, 0]),
    st.sampled_from([1, 1, 1, 2]),
    st.sampled_from([8, 4, 3]),
    st.one_of(st.integers(0, 300), st.just(2**32 - 1)),
    st.one_of(st.integers(0, 600), st.sampled_from([n for n in INTERESTING if n >= 0])),
)


@FUZZ
@given(
    prefix=st.binary(max_size=40),
    head=st.one_of(st.just(b""), _quantised_headers),
    tail=st.binary(max_size=400),
    offset=st.one_of(st.none(), st.integers(0, 60)),
)
def test_arbitrary_bytes_never_crash_the_quantised_parser(prefix, head, tail, offset):
    """`decode_quantized` parses payloads lying back to back, so it is fuzzed at offsets (None: where the
    header starts), behind headers that hold together (magic, version, bits) and claim any block and count."""
    buffer = prefix + head + tail
    offset = len(prefix) if offset is None else offset
    result = decodes_or_refuses(decode_quantized, buffer, offset)
    assert result is None or offset + 15 <= result[1] <= len(buffer)


# ----------------------------------------------------------------------------- through gRPC


GRPC_PUSHES = 300


def _server_outcome(scene, messages) -> tuple[grpc.StatusCode, str] | None:
    try:
        scene.stub.Push(iter(declared(messages)), timeout=10)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return None


def _local_outcome(scene, chunks) -> tuple[grpc.StatusCode, str] | None:
    """The refusal the decoder gives this exact chunk sequence here, or None if it decodes."""

    def vet(key, chunk):
        return scene.shard.vet_slice(key, chunk.codec, tuple(chunk.shape))

    try:
        list(assemble_units(chunks, vet))
    except DilocoxError as error:
        return grpc.StatusCode[error.status], str(error)
    return None


@pytest.mark.timeout(120)
def test_fuzzed_pushes_over_grpc_get_the_decoders_refusal_and_change_nothing(shard_set, reference_round_1):  # noqa: F811
    """Each push: every good slice but one, and a mutated stream for that one, at a random place."""
    scene, clients = open_round_scene(shard_set)
    try:
        rng = random.Random(20240601)
        before = full_state(scene.shard)
        sent = 0
        for attempt in range(GRPC_PUSHES):
            key = rng.choice(scene.keys)
            bad = mutate_stream(
                rng,
                list(
                    encode_slice(
                        key,
                        scene.deltas[key],
                        rng.choice(["fp32", "int8", "fp16"]),
                        chunk_bytes=rng.choice([64, 256, 4096]),
                    )
                ),
            )
            good = [m.chunk for m in good_messages(scene, without=key)]
            at = rng.randrange(len(good) + 1)
            chunks = good[:at] + bad + good[at:]
            expected = _local_outcome(scene, chunks)
            if expected is None:
                continue  # the mutation left a valid stream (e.g. chunks swapped): not bad input
            assert _server_outcome(scene, [header(), *as_messages(chunks)]) == expected, f"attempt {attempt}"
            sent += 1
            if sent % 50 == 0:
                assert scene.stub.Status(pb.StatusRequest(), timeout=10).open_round == 1
        assert sent >= GRPC_PUSHES * 0.8
        assert_unchanged(before, scene.shard)
        assert_round_completes(scene, reference_round_1)
    finally:
        for client in clients:
            client.close()
