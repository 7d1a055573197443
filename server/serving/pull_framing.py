"""A version's pull chunks are framed once and sent to every cluster that pulls the same bytes.

Every cluster of a round pulls the same version: one holding the previous version gets the same other
clusters' contributions as its peers (only its own part differs, and that goes as a digest summary), one
further behind or an observer gets the same weights and momentum. Framing them (the fp32 copy of the
weights, zstd over each chunk) once per pull made a shard's pull CPU grow with sites × sites for
contributions and sites × model for full pulls: 12–16 ms of shard CPU per site and round at 238 KB a
shard in `dilocox bench load --wan-mbit`, a third of it in framing the same bytes again.

`PullFramings.framed` hands out one `SharedFraming` per (what, version, contributor, slices): the first
pull that needs chunk i frames it and every other pull reads it, also while the first is still sending
(a round's pulls all start when its version is published). Chunks are kept until a pull of a newer
version comes (a pull is always served the newest version, so nothing asks for an older one again),
within a byte budget (`--pull-cache-mb`); a stream larger than what is left of the budget is framed per
pull as before, so a shard serving a model larger than its budget holds no second copy of it. The
chunks are the same bytes a per-pull framing makes (tests/test_pull_framing.py).

A chunk is kept and handed out as its wire bytes, serialized once when framed: Pull sends bytes as they
are (`add_servicer`, server/serving/aio_servicer.py), where each pull of a shared 238 KB chunk used to encode it
three times — twice to count its size, once for gRPC to send it (`ByteSize()` encodes in full).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator

from dilocox.proto import dilocox_pb2 as pb

DEFAULT_BUDGET_MB = 512
SLICE_SETS_KEPT = 4096  # distinct lists of slices pulled (one per layout's rank, and "all"): beyond, not shared


class SharedFraming:
    """The chunks of one framed stream, made on first need by whichever reader gets there first."""

    def __init__(self, source: Iterator[pb.TensorChunk], reserved_bytes: int) -> None:
        self._source = source
        self._chunks: list[bytes] = []
        self._error: BaseException | None = None
        self._done = False
        self._lock = threading.Lock()
        self.reserved_bytes = reserved_bytes

    def _chunk(self, i: int) -> bytes | None:
        with self._lock:
            while len(self._chunks) <= i and not self._done:
                try:
                    self._chunks.append(next(self._source).SerializeToString())
                except StopIteration:
                    self._done = True
                except BaseException as error:  # every reader fails the same way, none reads a torn stream
                    self._error, self._done = error, True
                if self._done:
                    self._source = None  # what it framed from (a snapshot's tensors) is not held by the chunks
            if i < len(self._chunks):
                return self._chunks[i]
            if self._error is not None:
                raise self._error
            return None

    def __iter__(self) -> Iterator[bytes]:
        i = 0
        while (chunk := self._chunk(i)) is not None:
            yield chunk
            i += 1


class PullFramings:
    """The shard's shared framings, by key, for the newest versions, within `budget_bytes`."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_MB << 20) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple, SharedFraming] = OrderedDict()
        self._slice_sets: dict[tuple, int] = {}
        self._reserved = 0
        self._lock = threading.Lock()
        self.streams_shared = 0  # pulls of a stream another pull had framed (or was framing)
        self.streams_framed = 0  # streams framed for sharing
        self.streams_unshared = 0  # streams framed for one pull: larger than the budget left

    def slice_set(self, keys: Iterable[Hashable]) -> int | None:
        """A small id for a pull's list of slices (a rank pulls its own slices: ranks of the same layout at
        every site ask for the same list), so that a key of `framed` hashes in constant time. None once
        `SLICE_SETS_KEPT` lists are known (pulls naming ever new lists are framed for themselves)."""
        keys = tuple(keys)
        with self._lock:
            known = self._slice_sets.get(keys)
            if known is None and len(self._slice_sets) < SLICE_SETS_KEPT:
                known = self._slice_sets[keys] = len(self._slice_sets)
            return known

    def framed(
        self, key: tuple, version: int, estimate_bytes: int, frame: Callable[[], Iterator[pb.TensorChunk]]
    ) -> Iterable[bytes]:
        """The chunks `frame()` makes for `key` in a pull of the published `version`, as wire bytes: shared with
        every pull of the same key and version (the entries of older versions are dropped here), or,
        where `estimate_bytes` (an upper bound of the framed size) does not fit the budget, framed for this
        pull alone. A key holding None (`slice_set`'s answer when full) is never shared."""
        if None in key:
            with self._lock:
                self.streams_unshared += 1
            return _serialized(frame())
        key = (version, *key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.streams_shared += 1
                return entry
            self._forget_before(version)
            while self._entries and self._reserved + estimate_bytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))  # least recently used first
            if estimate_bytes > self.budget_bytes - self._reserved:
                self.streams_unshared += 1
                return _serialized(frame())
            entry = self._entries[key] = SharedFraming(frame(), estimate_bytes)
            self._reserved += estimate_bytes
            self.streams_framed += 1
            return entry

    def _forget_before(self, version: int) -> None:
        for key in [k for k in self._entries if k[0] < version]:
            self._drop(key)

    def _drop(self, key: tuple) -> None:
        self._reserved -= self._entries.pop(key).reserved_bytes  # readers still sending keep their reference


def _serialized(chunks: Iterator[pb.TensorChunk]) -> Iterator[bytes]:
    return (chunk.SerializeToString() for chunk in chunks)
