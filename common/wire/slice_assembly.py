"""A stream's chunks assembled back into whole slices, each vetted as it completes: the receiving side of
`common/wire/framing.py`.

Its own module because it is the one piece that holds state across chunks — which units are open, which
bytes of each have arrived, which are done — and carries every refusal of a malformed stream (a unit
started twice, overlapping or out-of-range chunks, a stream ending with a unit incomplete). Framing, one
chunk at a time both ways (`frame_payload`, `decompress_chunk`, `open_bundle`), stays in framing.py; a
shard's push intake, a cluster's pull and the export read their streams through `assemble_units` here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from dilocox.common.wire import codecs
from dilocox.common.wire.bundle import BUNDLE_CODEC
from dilocox.common.wire.errors import InvalidFrame
from dilocox.common.wire.framing import SliceKey, decompress_chunk, key_of, meta_of, open_bundle
from dilocox.proto import dilocox_pb2 as pb


class SliceAssembler:
    """Collects the chunks of one slice, checks they tile its payload exactly, then decodes it."""

    def __init__(self, first: pb.TensorChunk, max_payload_bytes: int) -> None:
        self.key = key_of(first)
        self.codec = first.codec
        self.dtype = first.dtype
        self.shape = tuple(first.shape)
        self.payload_bytes = first.payload_bytes
        self.version = first.version
        codecs.check_known(self.codec)
        if not 0 <= self.payload_bytes <= max_payload_bytes:
            raise InvalidFrame(
                f"{self.key}: payload of {self.payload_bytes} bytes is outside [0, {max_payload_bytes}] for codec "
                f"{self.codec}"
            )
        self._buffer = bytearray(self.payload_bytes)
        self._covered: list[tuple[int, int]] = []
        self._filled = 0

    def add(self, chunk: pb.TensorChunk) -> bool:
        """Place one chunk; True once the payload is complete. Overlaps and out-of-range chunks are refused."""
        if (chunk.codec, chunk.dtype, tuple(chunk.shape), chunk.payload_bytes) != (
            self.codec,
            self.dtype,
            self.shape,
            self.payload_bytes,
        ):
            raise InvalidFrame(f"{self.key}: chunks disagree on codec/dtype/shape/payload size")
        start, stop = chunk.offset, chunk.offset + chunk.raw_bytes
        if start < 0 or stop > self.payload_bytes:
            raise InvalidFrame(
                f"{self.key}: chunk [{start}, {stop}) lies outside the {self.payload_bytes}-byte payload"
            )
        for a, b in self._covered:
            if start < b and a < stop:
                raise InvalidFrame(f"{self.key}: chunk [{start}, {stop}) overlaps bytes [{a}, {b}) already received")
        if stop == start and self.payload_bytes != 0:
            raise InvalidFrame(f"{self.key}: empty chunk at offset {start}")
        raw = decompress_chunk(chunk)
        self._buffer[start:stop] = raw
        self._covered.append((start, stop))
        self._filled += stop - start
        return self.complete

    @property
    def complete(self) -> bool:
        return self._filled == self.payload_bytes and bool(self._covered)

    def vet(self) -> None:
        """Refuse the completed payload if it would not decode (see `codecs.vet`)."""
        if not self.complete:
            raise InvalidFrame(f"{self.key}: stream ended with {self._filled} of {self.payload_bytes} payload bytes")
        codecs.vet(self.codec, self._buffer, self.dtype, self.shape)


@dataclass
class Assembled:
    """One complete unit of a stream: a slice's payload, vetted (it decodes), with the frame's metadata."""

    key: SliceKey
    payload: bytearray
    meta: pb.TensorChunk  # the first chunk, without its data: codec, dtype, version, contributor, …

    def decode(self) -> torch.Tensor:
        """The payload decoded (an fp32 payload decodes to a view of it); not kept: a holder of many units
        decodes each when it reaches it, so that never all of them are dense at once."""
        return codecs.decode(self.meta.codec, self.payload, self.meta.dtype, tuple(self.meta.shape), vetted=True)

    def decode_lazy(self) -> torch.Tensor | codecs.OrderedProduct:
        """`decode`, a low-rank payload as its factors (`codecs.decode_lazy`)."""
        return codecs.decode_lazy(self.meta.codec, self.payload, self.meta.dtype, tuple(self.meta.shape), vetted=True)


def unit_of(chunk: pb.TensorChunk) -> tuple:
    """What makes a unit distinct in a stream: a slice, and on a contributions pull, whose part it is and
    of which round (a cluster several versions behind gets each round since the one it holds)."""
    return (key_of(chunk), chunk.contributor, chunk.momentum, chunk.version)


def assemble_units(
    chunks: Iterable[pb.TensorChunk],
    max_payload_bytes: Callable[[SliceKey, pb.TensorChunk], int],
    slice_map: Sequence[tuple[SliceKey, tuple[int, ...]]] = (),
) -> Iterator[Assembled]:
    """Yield each unit as soon as its last chunk arrives (a bundle's slices as soon as it does).

    `max_payload_bytes(key, first_chunk)` vets each new unit before any buffer is allocated (the server
    raises UnknownSlice / ShapeMismatch there). A unit that starts twice, or a stream that ends with a
    unit incomplete, is an InvalidFrame. `slice_map` (the run's (key, slice shape) list) resolves the
    slices of bundles; a stream with bundles and no slice map is an InvalidFrame.
    """
    open_units: dict[tuple, tuple[SliceAssembler, pb.TensorChunk]] = {}
    done: set[tuple] = set()
    for chunk in chunks:
        if chunk.codec == BUNDLE_CODEC:
            for meta, payload in open_bundle(chunk, slice_map):
                unit = unit_of(meta)
                if unit in done or unit in open_units:
                    raise InvalidFrame(f"{unit[0]}: the slice comes twice in this stream")
                limit = max_payload_bytes(unit[0], meta)
                if len(payload) > limit:
                    raise InvalidFrame(
                        f"{unit[0]}: payload of {len(payload)} bytes is over {limit} for codec {meta.codec}"
                    )
                done.add(unit)
                buffer = bytearray(payload)
                codecs.vet(meta.codec, buffer, meta.dtype, tuple(meta.shape))
                yield Assembled(unit[0], buffer, meta)
            continue
        unit = unit_of(chunk)
        key = unit[0]
        if unit in done:
            raise InvalidFrame(f"{key}: chunk after the slice was already complete in this stream")
        entry = open_units.get(unit)
        if entry is None:
            limit = max_payload_bytes(key, chunk)
            meta = meta_of(chunk)
            entry = open_units[unit] = (SliceAssembler(chunk, limit), meta)
        assembler, meta = entry
        if assembler.add(chunk):
            del open_units[unit]
            done.add(unit)
            assembler.vet()
            yield Assembled(key, assembler._buffer, meta)
    if open_units:
        names = ", ".join(str(u[0]) for u in sorted(open_units, key=lambda u: (u[0], u[1], u[2])))
        raise InvalidFrame(f"stream ended with incomplete slices: {names}")


def assemble(
    chunks: Iterable[pb.TensorChunk],
    max_payload_bytes: Callable[[SliceKey, pb.TensorChunk], int],
    slice_map: Sequence[tuple[SliceKey, tuple[int, ...]]] = (),
) -> Iterator[tuple[SliceKey, torch.Tensor, int]]:
    """Yield (key, tensor, version) for each slice of a plain stream (pushes, weight pulls)."""
    for unit in assemble_units(chunks, max_payload_bytes, slice_map):
        yield unit.key, unit.decode(), unit.meta.version
