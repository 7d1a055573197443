"""A flat fp32 buffer kept on local disk between uses: the round's start s_t under `--spill-dir`.

The start is touched twice a round — written at the boundary (the next start), read at the next one (Δ =
s − θ) — and idle for the minutes of training between. Kept in host memory it is 4 of the exchange's 16
bytes per owned parameter; here it is a shared mapping of a file on the node's local disk, and after each
boundary `rest()` writes its pages out and hands them back to the kernel (msync, MADV_DONTNEED, then
POSIX_FADV_DONTNEED for the page cache), in a thread, while the next round trains. The next access waits
for that and faults the pages back in from disk: one sequential write and one read of 4 B per parameter a
round, at NVMe speed, against a WAN round of minutes. The values are the buffer's own bits: nothing is
converted, so the run is bit-identical to one that keeps the start in memory (tests/test_spill.py).

The file is unlinked as soon as it is mapped: its blocks are freed when the process ends, however it
ends, so no spill file outlives its worker. A directory on tmpfs saves nothing (its pages are memory):
refused by name. Where a GPU copies from it the buffer is pageable (torch copies through its own staging).
"""

from __future__ import annotations

import mmap
import os
import pathlib
import tempfile
import threading

import structlog
import torch

log = structlog.get_logger()

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs")


class SpillError(ValueError):
    pass


def filesystem_of(path: pathlib.Path) -> str:
    """The type of the filesystem `path` is on, from /proc/mounts (the longest mount point above it)."""
    path = path.resolve()
    best, kind = "", ""
    try:
        lines = pathlib.Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == pathlib.Path(point) or pathlib.Path(point) in path.parents) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def check_spill_dir(directory: str | os.PathLike) -> pathlib.Path:
    """The directory, created if missing; refused by name where spilling cannot save host memory."""
    path = pathlib.Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SpillError(f"--spill-dir {path}: cannot create it ({error.strerror})") from None
    if not os.access(path, os.W_OK):
        raise SpillError(f"--spill-dir {path}: not writable")
    kind = filesystem_of(path)
    if kind in MEMORY_FILESYSTEMS:
        raise SpillError(
            f"--spill-dir {path} is on {kind}, which keeps its files in memory: spilling there saves "
            "no host memory; give a directory on a local disk"
        )
    return path


class SpillBuffer:
    """`numel` fp32 elements in a file under `directory`, mapped shared; `tensor` is the flat buffer."""

    def __init__(self, directory: str | os.PathLike, numel: int, name: str = "start") -> None:
        path = check_spill_dir(directory)
        self.nbytes = 4 * numel
        self._resting: threading.Thread | None = None
        fd, file_path = tempfile.mkstemp(prefix=f"dilocox-{name}-{os.getpid()}-", suffix=".f32", dir=path)
        try:
            os.unlink(file_path)  # the mapping keeps the inode: its blocks go when the process does
            if self.nbytes:
                os.ftruncate(fd, self.nbytes)
                try:
                    os.posix_fallocate(fd, 0, self.nbytes)  # a full disk fails here, not at a page fault mid-run
                except OSError as error:
                    raise SpillError(
                        f"--spill-dir {path}: cannot reserve {self.nbytes / 1e9:.2f} GB ({error.strerror})"
                    ) from None
                self._map: mmap.mmap | None = mmap.mmap(
                    fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
                self.tensor = torch.frombuffer(self._map, dtype=torch.float32, count=numel)
            else:
                self._map = None
                self.tensor = torch.empty(0, dtype=torch.float32)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        log.info("exchange_spill", directory=str(path), bytes=self.nbytes, filesystem=filesystem_of(path))

    def rest(self) -> None:
        """Write the buffer's pages to disk and give them back, in a thread (the next `settle` waits)."""
        self.settle()
        if self._map is None:
            return
        self._resting = threading.Thread(target=self._page_out, name="spill-rest", daemon=True)
        self._resting.start()

    def _page_out(self) -> None:
        assert self._map is not None
        self._map.flush()  # msync: the file holds every value
        self._map.madvise(mmap.MADV_DONTNEED)  # unmapped from this process (a shared file mapping keeps the data)
        os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)  # and out of the page cache

    def settle(self) -> None:
        """Wait for a `rest` in progress: the buffer may be read and written again."""
        if self._resting is not None:
            self._resting.join()
            self._resting = None

    def resident_bytes(self) -> int:
        """Bytes of the mapping in this process's memory now (its `Rss` in /proc/self/smaps)."""
        if self._map is None:
            return 0
        start = self.tensor.data_ptr()
        try:
            lines = pathlib.Path("/proc/self/smaps").read_text().splitlines()
        except OSError:
            return self.nbytes
        inside = False
        for line in lines:
            head = line.split(" ", 1)[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= start < high
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
        return self.nbytes
