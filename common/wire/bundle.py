"""Slice bundles: many small slice payloads in one chunk, under one zstd frame.

Why: a compressed round is made of many small payloads (a rank-8 factor pair is ~2.5 KB, an int4
bias 83 bytes). Framed one by one, each pays for its own TensorChunk fields (name, codec, dtype,
shape, sizes) and its own zstd frame, and zstd sees too little of the int4 codes to entropy-code
them well (−12% on a lone factor pair against −23% on a shard's worth). On the default sim model
that framing was 16% of a round's bytes (docs/decisions.md). A bundle carries the payloads of
consecutive slices back to back, each named by its position in the run's slice map (which both ends
know from Join), so the per-slice cost drops to a few bytes and one frame covers them all.

Bundles only ever hold slices whose payloads fit one chunk together: a bundle is always exactly one
chunk (one zstd frame, ≤ chunk_bytes raw), and a payload too large to share a chunk travels on its
own as before. A receiver therefore still never holds more than one chunk's worth of a bundle.

Layout of a bundle payload (little-endian), version `BUNDLE_VERSION`:

    header  struct "<BBH" (4 bytes): magic 0xB5, version, entry count
    entries count × (struct "<IIBB": slice index, payload bytes, codec length, dtype length,
                     then the codec and dtype names in ASCII)
    payloads the entries' payloads, in entry order, back to back (their lengths sum to the rest)

The chunk that carries it has codec "bundle", no name and no shape; its other fields (version,
contributor, weight, is_delta, momentum…) apply to every slice inside. This module is the pure byte
layout; `common.framing` groups slices into bundles (`frame_slices`) and opens them on receipt.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from dilocox.common.wire import codecs
from dilocox.common.wire.errors import InvalidFrame, UnknownCodec

BUNDLE_CODEC = "bundle"
BUNDLE_VERSION = 1
_MAGIC = 0xB5
_HEADER = struct.Struct("<BBH")
_ENTRY = struct.Struct("<IIBB")
HEADER_BYTES = _HEADER.size
MAX_ENTRIES = 2**16 - 1


class BundleEntry(NamedTuple):
    index: int  # position of the slice in the run's slice map
    codec: str
    dtype: str
    payload: bytes


def entry_bytes(codec: str, dtype: str, payload_len: int) -> int:
    """What one slice adds to a bundle payload (before zstd)."""
    return _ENTRY.size + len(codec) + len(dtype) + payload_len


def _ascii(name: str, what: str) -> bytes:
    raw = name.encode("ascii")
    if len(raw) > 255:
        raise ValueError(f"{what} name {name!r} is longer than 255 bytes")
    return raw


def pack_bundle(entries: Sequence[BundleEntry]) -> bytes:
    """One bundle payload from its entries, in the given order."""
    if not 0 < len(entries) <= MAX_ENTRIES:
        raise ValueError(f"a bundle holds 1 to {MAX_ENTRIES} slices, got {len(entries)}")
    parts = [_HEADER.pack(_MAGIC, BUNDLE_VERSION, len(entries))]
    for entry in entries:
        codec, dtype = _ascii(entry.codec, "codec"), _ascii(entry.dtype, "dtype")
        parts += [_ENTRY.pack(entry.index, len(entry.payload), len(codec), len(dtype)), codec, dtype]
    parts += [entry.payload for entry in entries]
    return b"".join(parts)


def unpack_bundle(raw: bytes | bytearray, num_slices: int) -> list[BundleEntry]:
    """The entries of one bundle payload, for a run of `num_slices` slices.

    Everything is checked before an entry is returned: magic, version, entry table within the buffer,
    indices below `num_slices` and not repeated, known codecs, and payload lengths that add up to
    exactly the bytes after the table. Malformed bytes raise InvalidFrame, a newer version UnknownCodec.
    """
    view = memoryview(raw)
    if len(view) < _HEADER.size:
        raise InvalidFrame(f"bundle of {len(view)} bytes: its header needs {_HEADER.size}")
    magic, version, count = _HEADER.unpack_from(view, 0)
    if magic != _MAGIC:
        raise InvalidFrame(f"bundle: bad magic 0x{magic:02X} (expected 0x{_MAGIC:02X})")
    if version != BUNDLE_VERSION:
        raise UnknownCodec(f"bundle version {version}; this build decodes version {BUNDLE_VERSION}")
    if count == 0:
        raise InvalidFrame("bundle with no slices")
    pos = _HEADER.size
    table: list[tuple[int, int, str, str]] = []
    for _ in range(count):
        if pos + _ENTRY.size > len(view):
            raise InvalidFrame(f"bundle: the table of {count} slices runs past its {len(view)} bytes")
        index, length, codec_len, dtype_len = _ENTRY.unpack_from(view, pos)
        pos += _ENTRY.size
        if pos + codec_len + dtype_len > len(view):
            raise InvalidFrame(f"bundle: the table of {count} slices runs past its {len(view)} bytes")
        try:
            codec = bytes(view[pos : pos + codec_len]).decode("ascii")
            dtype = bytes(view[pos + codec_len : pos + codec_len + dtype_len]).decode("ascii")
        except UnicodeDecodeError:
            raise InvalidFrame("bundle: a codec or dtype name is not ASCII") from None
        pos += codec_len + dtype_len
        if index >= num_slices:
            raise InvalidFrame(f"bundle names slice {index}; the run has {num_slices} slices")
        if codec == BUNDLE_CODEC:
            raise InvalidFrame("bundle inside a bundle")
        codecs.check_known(codec)
        table.append((index, length, codec, dtype))
    if len({index for index, *_ in table}) != count:
        raise InvalidFrame("bundle names a slice twice")
    declared = sum(length for _, length, *_ in table)
    if declared != len(view) - pos:
        raise InvalidFrame(f"bundle: its slices declare {declared} payload bytes, {len(view) - pos} follow the table")
    entries = []
    for index, length, codec, dtype in table:
        entries.append(BundleEntry(index, codec, dtype, bytes(view[pos : pos + length])))
        pos += length
    return entries
