"""Tensor slices on the wire: encode → split into chunks → one zstd frame per chunk, and back.

Why per-chunk zstd frames rather than one compressed stream: every gRPC message then stands alone (a
retried or reordered chunk decodes by itself), no message comes near gRPC's 4 MiB default limit, and
a receiver never holds more than one slice's payload. Small slices share a chunk (`frame_slices`, a
`common.bundle`): one frame then covers many of them. Each frame carries zstd's content checksum and
content size, so truncation and bit flips are caught before anything is applied.

The payload codec (how a tensor becomes bytes) is pluggable through `common.codecs`; this module only
moves bytes. Frames are protobuf `TensorChunk` messages (plain data, no gRPC). This module handles one
chunk at a time, both ways; putting a whole stream's chunks back together into vetted slices
(`assemble_units`) is common/wire/slice_assembly.py.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import zstandard

from dilocox.common.wire import codecs
from dilocox.common.wire.bundle import (
    BUNDLE_CODEC,
    HEADER_BYTES,
    MAX_ENTRIES,
    BundleEntry,
    entry_bytes,
    pack_bundle,
    unpack_bundle,
)
from dilocox.common.wire.errors import CorruptFrame, InvalidFrame
from dilocox.proto import dilocox_pb2 as pb

DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
# Hard ceiling a receiver accepts for one chunk's decompressed size, whatever the header claims:
# bounds the memory one message can make a shard allocate.
MAX_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, order=True)
class SliceKey:
    """Identifies a contiguous row range of one parameter."""

    name: str
    row_start: int
    row_stop: int

    def __str__(self) -> str:
        return f"{self.name}[{self.row_start}:{self.row_stop}]"


@dataclass(frozen=True)
class EncodedSlice:
    """One slice as it travelled: codec, dtype, shape and payload bytes.

    A `bytearray` payload is decoded in place (an fp32 slice becomes a view of its bytes, no copy):
    whoever builds one hands the buffer over and never writes to it again, and nothing writes to a
    decoded tensor."""

    key: SliceKey
    codec: str
    dtype: str
    shape: tuple[int, ...]
    payload: bytes | bytearray
    vetted: bool = field(default=False, compare=False)
    """The payload passed `codecs.vet` as it arrived (an `Assembled` unit's buffer, handed over): its
    decodes skip the finiteness pass. False for anything else (read from a checkpoint, built locally)."""

    @classmethod
    def exact(cls, key: SliceKey, tensor: torch.Tensor) -> EncodedSlice:
        """An uncompressed (fp32) slice, for callers that hold plain tensors."""
        payload, dtype = codecs.encode("fp32", tensor)
        return cls(key, "fp32", dtype, tuple(tensor.shape), bytearray(payload))

    def decode(self) -> torch.Tensor:
        return codecs.decode(self.codec, self._buffer(), self.dtype, self.shape, self.vetted)

    def decode_lazy(self) -> torch.Tensor | codecs.OrderedProduct:
        """`decode`, a low-rank payload as its factors (`codecs.decode_lazy`)."""
        return codecs.decode_lazy(self.codec, self._buffer(), self.dtype, self.shape, self.vetted)

    def _buffer(self) -> bytearray:
        return self.payload if isinstance(self.payload, bytearray) else bytearray(self.payload)

    @functools.cached_property
    def sha256(self) -> bytes:
        """SHA-256 of the payload, computed once: a shard hashes a push's slices as it commits them, outside
        its lock, and the round's provenance record and every pull's own-contribution summary reuse it (the
        payload is never written after it is handed over)."""
        return hashlib.sha256(self.payload).digest()


def key_of(chunk: pb.TensorChunk) -> SliceKey:
    return SliceKey(chunk.name, chunk.row_start, chunk.row_stop)


def own_contribution_digest(slices: dict[SliceKey, bytes]) -> bytes:
    """Digest of a cluster's own part of a round, from each slice's payload sha256: sha256 over the
    concatenated digests in sorted key order. Shard and cluster compute it independently, so one
    32-byte value confirms the cluster still holds exactly what the shard applied."""
    return hashlib.sha256(b"".join(slices[key] for key in sorted(slices))).digest()


def is_own_summary(chunk: pb.TensorChunk) -> bool:
    """The one nameless chunk of a contributions pull that stands for the requester's own slices."""
    return chunk.own and not chunk.name


def is_state_digest(chunk: pb.TensorChunk) -> bool:
    """The nameless last chunk of a contributions pull carrying the shard's state digest."""
    return chunk.state_digest and not chunk.name


def encode_slice(
    key: SliceKey,
    tensor: torch.Tensor,
    codec: str = "fp32",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    zstd_level: int = 1,
    version: int = 0,
) -> Iterator[pb.TensorChunk]:
    """Encode one slice with a stateless codec and yield its chunks (see `frame_payload`)."""
    payload, dtype = codecs.encode(codec, tensor)
    yield from frame_payload(key, payload, codec, dtype, tuple(tensor.shape), chunk_bytes, zstd_level, version)


def frame_payload(
    key: SliceKey,
    payload: bytes | memoryview,
    codec: str,
    dtype: str,
    shape: tuple[int, ...],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    zstd_level: int = 1,
    version: int = 0,
    **fields: object,
) -> Iterator[pb.TensorChunk]:
    """Split an encoded payload into chunks of ≤ `chunk_bytes` raw bytes, each a standalone zstd frame.

    `fields` sets further TensorChunk fields on every chunk (a pull's contributor, weight, momentum…).
    """
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    view = memoryview(payload)
    total = len(view)
    compressor = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True, write_content_size=True)
    offset = 0
    while True:  # at least one chunk, even for an empty payload
        piece = view[offset : offset + chunk_bytes]
        yield pb.TensorChunk(
            name=key.name,
            row_start=key.row_start,
            row_stop=key.row_stop,
            codec=codec,
            dtype=dtype,
            shape=list(shape),
            payload_bytes=total,
            offset=offset,
            raw_bytes=len(piece),
            zstd_frame=compressor.compress(piece),
            version=version,
            **fields,
        )
        offset += len(piece)
        if offset >= total:
            break


def frame_slices(
    items: Iterable[EncodedSlice],
    slice_index: Mapping[SliceKey, int],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    zstd_level: int = 1,
    **fields: object,
) -> Iterator[pb.TensorChunk]:
    """Chunks for `items`, in order: consecutive payloads that fit one chunk together travel as one
    bundle (`common.bundle`; `slice_index` gives each slice's position in the run's slice map), a
    payload over half a chunk travels alone (`frame_payload`). `fields` go on every chunk (version,
    contributor, …). Lazy: it holds at most one chunk's worth of small payloads at a time."""
    pending: list[EncodedSlice] = []
    pending_bytes = HEADER_BYTES
    for item in items:
        size = entry_bytes(item.codec, item.dtype, len(item.payload))
        if len(item.payload) > chunk_bytes // 2:
            yield from _flush(pending, slice_index, chunk_bytes, zstd_level, fields)
            pending, pending_bytes = [], HEADER_BYTES
            yield from frame_payload(
                item.key, item.payload, item.codec, item.dtype, item.shape, chunk_bytes, zstd_level, **fields
            )
            continue
        if pending and (pending_bytes + size > chunk_bytes or len(pending) == MAX_ENTRIES):
            yield from _flush(pending, slice_index, chunk_bytes, zstd_level, fields)
            pending, pending_bytes = [], HEADER_BYTES
        pending.append(item)
        pending_bytes += size
    yield from _flush(pending, slice_index, chunk_bytes, zstd_level, fields)


def _flush(
    pending: list[EncodedSlice], slice_index: Mapping[SliceKey, int], chunk_bytes: int, zstd_level: int, fields: dict
) -> Iterator[pb.TensorChunk]:
    """One chunk for the pending slices: a bundle, or the plain framing when there is only one."""
    if len(pending) == 1:
        item = pending[0]
        yield from frame_payload(
            item.key, item.payload, item.codec, item.dtype, item.shape, chunk_bytes, zstd_level, **fields
        )
    elif pending:
        payload = pack_bundle([BundleEntry(slice_index[i.key], i.codec, i.dtype, i.payload) for i in pending])
        yield from frame_payload(SliceKey("", 0, 0), payload, BUNDLE_CODEC, "", (), chunk_bytes, zstd_level, **fields)


def meta_of(chunk: pb.TensorChunk) -> pb.TensorChunk:
    """A chunk's fields less its bytes: what a slice keeps of its first chunk. Copying the chunk whole and then
    clearing its frame copied the frame once per slice — for a bundle, once per slice in it (a 2 MB bundle of
    96 slices: 192 MB moved for one push; 0.74 of a shard's 8.3 CPU s a round at 256 such sites)."""
    meta = pb.TensorChunk()
    for descriptor, value in chunk.ListFields():
        if descriptor.name == "zstd_frame":
            continue
        if descriptor.is_repeated:
            getattr(meta, descriptor.name).extend(value)
        else:
            setattr(meta, descriptor.name, value)
    return meta


def open_bundle(
    chunk: pb.TensorChunk, slice_map: Sequence[tuple[SliceKey, tuple[int, ...]]]
) -> Iterator[tuple[pb.TensorChunk, bytes]]:
    """The slices of a bundle chunk as (metadata, payload): each one's metadata is the bundle chunk's
    (version, contributor, …) with the slice's key, codec, dtype, shape and size filled in.
    `slice_map[i]` is the (key, slice shape) of slice i in the run's slice map."""
    if not slice_map:
        raise InvalidFrame("a slice bundle arrived where the run's slice map is not known yet")
    if chunk.name or chunk.offset or list(chunk.shape) or chunk.raw_bytes != chunk.payload_bytes:
        raise InvalidFrame("a slice bundle must travel as one whole chunk with no name and no shape")
    raw = decompress_chunk(chunk)
    base = meta_of(chunk)
    for entry in unpack_bundle(raw, len(slice_map)):
        key, shape = slice_map[entry.index]
        meta = pb.TensorChunk()
        meta.CopyFrom(base)
        meta.name, meta.row_start, meta.row_stop = key.name, key.row_start, key.row_stop
        meta.codec, meta.dtype = entry.codec, entry.dtype
        meta.shape[:] = list(shape)
        meta.payload_bytes = meta.raw_bytes = len(entry.payload)
        yield meta, entry.payload


def decompress_chunk(chunk: pb.TensorChunk) -> bytes:
    """The raw bytes of one chunk; raises CorruptFrame for anything but an intact frame of the declared size."""
    if not 0 <= chunk.raw_bytes <= MAX_CHUNK_BYTES:
        raise InvalidFrame(f"chunk of {key_of(chunk)} declares {chunk.raw_bytes} raw bytes (limit {MAX_CHUNK_BYTES})")
    frame = chunk.zstd_frame
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CorruptFrame(f"chunk of {key_of(chunk)} at offset {chunk.offset}: not a zstd frame ({exc})") from None
    if declared != chunk.raw_bytes:
        raise CorruptFrame(
            f"chunk of {key_of(chunk)} at offset {chunk.offset}: frame holds {declared} bytes, header says "
            f"{chunk.raw_bytes}"
        )
    if declared == 0:
        return _verified_empty(chunk, frame)
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=MAX_CHUNK_BYTES, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptFrame(f"chunk of {key_of(chunk)} at offset {chunk.offset}: corrupt zstd frame ({exc})") from None
    if len(raw) != chunk.raw_bytes:
        raise CorruptFrame(f"chunk of {key_of(chunk)}: decompressed {len(raw)} bytes, expected {chunk.raw_bytes}")
    return raw


def _verified_empty(chunk: pb.TensorChunk, frame: bytes) -> bytes:
    """Decode a frame that claims 0 bytes. python-zstandard's one-shot `decompress` returns b"" for such a
    frame without reading its blocks or checksum, so junk after the header passed; a streaming decode
    checks them (and stops at the first byte of output, so it cannot be made to allocate)."""
    decoder = zstandard.ZstdDecompressor().decompressobj()
    try:
        raw = decoder.decompress(frame)
    except zstandard.ZstdError as exc:
        raise CorruptFrame(f"chunk of {key_of(chunk)} at offset {chunk.offset}: corrupt zstd frame ({exc})") from None
    if raw or not decoder.eof or decoder.unused_data:
        raise CorruptFrame(f"chunk of {key_of(chunk)} at offset {chunk.offset}: corrupt empty zstd frame")
    return b""


def wire_bytes(message: bytes | pb.TensorChunk | pb.PushMessage) -> bytes:
    """A message as it crosses the wire: bytes serialized before (once, for many sends) pass as they are."""
    return message if type(message) is bytes else message.SerializeToString()


def stream_bytes(chunks: Iterable[pb.TensorChunk]) -> int:
    """Serialized size of a chunk sequence: what crosses the wire."""
    return sum(c.ByteSize() for c in chunks)
