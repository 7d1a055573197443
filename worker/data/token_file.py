"""A prepared token file read window by window with `pread`: a corpus far larger than RAM costs a worker
no more memory than a small one.

Why not a memory map: measured on this project's machines, a `np.memmap` worker grew by ~210 MB of
resident memory over its first 100 batches of 8 random windows from a 512 MB file (and kept growing),
although each batch reads 1 KB. The page cache hands out large folios (up to 2 MB), a page fault maps
the whole folio, and mapped file pages count in RSS; `madvise(MADV_RANDOM)` did not change it. `pread`
copies just the window's bytes into the process and leaves the rest in the (reclaimable, unmapped)
page cache: the same run stayed flat. See docs/decisions.md.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np


class TokenFile:
    """1-D token ids stored in `path` (from `start`, `length` of them), sliceable like an array; reading
    is explicit (`windows`, `read`), so nothing can load the whole file by accident."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype, start: int = 0, length: int | None = None) -> None:
        self.path = pathlib.Path(path)
        self.dtype = np.dtype(dtype)
        total = self.path.stat().st_size // self.dtype.itemsize
        self.start = start
        self.length = total - start if length is None else length
        if start < 0 or self.length < 0 or start + self.length > total:
            raise ValueError(f"tokens [{start}, {start + self.length}) outside the {total} in {self.path}")
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> TokenFile:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a TokenFile is sliced with [start:stop] only; read tokens with windows() or read()")
        begin, end, _ = key.indices(self.length)
        return TokenFile(self.path, self.dtype, self.start + begin, max(0, end - begin))

    def read(self, start: int = 0, count: int | None = None) -> np.ndarray:
        count = self.length - start if count is None else count
        if start < 0 or count < 0 or start + count > self.length:
            raise IndexError(f"tokens [{start}, {start + count}) outside [0, {self.length})")
        size = self.dtype.itemsize
        data = os.pread(self._fd, count * size, (self.start + start) * size)
        if len(data) != count * size:
            raise OSError(f"{self.path}: short read ({len(data)} of {count * size} bytes): was the file truncated?")
        return np.frombuffer(data, dtype=self.dtype)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """[len(starts), length] token ids, one `pread` per window."""
        out = np.empty((len(starts), length), dtype=self.dtype)
        for row, start in enumerate(starts):
            out[row] = self.read(int(start), length)
        return out
