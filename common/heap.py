"""Keep freed heap memory for reuse instead of handing it back to the kernel after every message.

Why: a shard (or a site's exchange) allocates and frees buffers of a few hundred KB per message — a
push's chunk as protobuf parses it, the bytes `ByteSize()` encodes into, a zstd frame, a pull's framing.
glibc returns the top of its heap to the kernel as soon as more than `M_TRIM_THRESHOLD` (128 KB by
default, raised only by its own heuristics) is free there, so the next message's buffer faults its pages
in again, each zeroed by the kernel: `ByteSize()` of a 240 KB chunk took 200 µs that way and 10 µs with the
top of the heap kept (`bench load` at 256 sites: page faults and page clearing were a tenth of a shard's
CPU). `M_TOP_PAD` keeps that much free above the heap's top when it grows and when it is trimmed — a
fixed amount of idle memory (64 MB), small beside any shard's or site's tensors.

Only where the C library is glibc (`mallopt` is glibc's); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger()
M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3  # glibc's malloc.h
DEFAULT_TOP_PAD_BYTES = 64 << 20
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its dynamic threshold


def keep_freed_heap(top_pad_bytes: int = DEFAULT_TOP_PAD_BYTES) -> bool:
    """Ask glibc to keep `top_pad_bytes` free at the top of the heap (see the module's docstring). True if it
    took the setting; False where there is no glibc `mallopt`."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Both, and in this order: setting either stops glibc's own raising of the mmap threshold, and below it
    # every buffer of a few hundred KB would be mapped and unmapped per message instead.
    taken = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TOP_PAD, top_pad_bytes))
    log.debug("heap_top_pad", bytes=top_pad_bytes, taken=taken)
    return taken
