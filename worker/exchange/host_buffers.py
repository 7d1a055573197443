"""The host memory of a rank's round boundary: two flat fp32 buffers over the parameters it owns.

* `start` — s_t, where the current round started (the model as the rank last wrote it);
* `outgoing` — what the round sends: Δ + e, added in as θ arrives (worker/exchange/outgoing.py), which
  the background communicator compresses in place while the next round trains; between rounds, with
  error feedback, the compressor's residual e itself.

Both are one allocation each (`start` page-locked where a GPU copies from it), with views per parameter
and per slice, so the boundary is in-place arithmetic — never a dictionary of fresh per-parameter
tensors. Together with the client's replica of the global weights and the outer momentum (4 + 4 bytes),
that is all a rank keeps for the exchange: 16 bytes per owned parameter (docs/decisions.md, "The round
boundary"). With `spill_dir` the start lives in a file on local disk between boundaries
(worker/exchange/spill.py): 12 bytes in memory, the same bits.
"""

from __future__ import annotations

import math
import weakref

import structlog
import torch

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.framing import SliceKey
from dilocox.worker.exchange.spill import SpillBuffer

log = structlog.get_logger()


def host_empty(numel: int, pinned: bool = False) -> torch.Tensor:
    """`numel` fp32 elements on the host; `pinned`: page-locked by registering them with CUDA (as DCP's
    checkpoint stager does), not by `pin_memory=True`, whose caching host allocator rounds each block up to
    a power of two (a 4.4 GB start would take 8 GB) and keeps freed blocks for itself. Unregistered when the
    tensor goes. Where registration fails the buffer stays pageable (copies are then synchronous), and the
    log says so."""
    tensor = torch.empty(numel, dtype=torch.float32)
    if not (pinned and numel and torch.cuda.is_available()):
        return tensor
    from torch.cuda import _pin_memory_utils as pins

    try:
        pins.pin_memory(tensor.data_ptr(), tensor.nbytes)
    except RuntimeError as error:
        log.warning("host_buffer_not_pinned", bytes=tensor.nbytes, error=str(error)[:200])
        return tensor
    finalizer = weakref.finalize(tensor, pins.unpin_memory, tensor.data_ptr())
    finalizer.atexit = False  # never after the CUDA context is gone
    return tensor


class HostBuffers:
    def __init__(self, shapes: dict[str, tuple[int, ...]], pinned: bool = False, spill_dir: str = "") -> None:
        self.shapes = dict(shapes)
        self.numel = sum(math.prod(s) for s in self.shapes.values())
        # `start` is scattered to the device; `outgoing` only ever meets the host (θ reaches it through the
        # access's own bounded landing buffer).
        self.spill = SpillBuffer(spill_dir, self.numel) if spill_dir else None
        if self.spill is not None:
            self._start = self.spill.tensor
        else:
            self._start = host_empty(self.numel, pinned)
        self._outgoing = torch.zeros(self.numel, dtype=torch.float32)
        self._start_views = self._views(self._start)
        self.outgoing = self._views(self._outgoing)
        self.pinned = pinned and self.spill is None

    @property
    def start(self) -> dict[str, torch.Tensor]:
        """s_t per parameter (a spilled start is back in memory once this returns)."""
        if self.spill is not None:
            self.spill.settle()
        return self._start_views

    def rest_start(self) -> None:
        """The start is not needed until the next boundary: a spilled one goes back to disk meanwhile."""
        if self.spill is not None:
            self.spill.rest()

    @property
    def resident_nbytes(self) -> int:
        """What the two buffers hold in host memory now (a spilled start: only its pages in memory)."""
        start = self.spill.resident_bytes() if self.spill is not None else self._start.nbytes
        return start + self._outgoing.nbytes

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views, offset = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            views[name] = flat[offset : offset + n].view(shape)
            offset += n
        return views

    @property
    def nbytes(self) -> int:
        return self._start.nbytes + self._outgoing.nbytes

    def holds(self, tensor: torch.Tensor | None) -> bool:
        """Whether `tensor` is a view into one of the two buffers (a residual kept in `outgoing`)."""
        if tensor is None or tensor.device.type != "cpu":
            return False
        pointer = tensor.data_ptr()
        return any(flat.data_ptr() <= pointer < flat.data_ptr() + flat.nbytes for flat in (self._start, self._outgoing))

    @staticmethod
    def slices_of(views: dict[str, torch.Tensor], slices: list[ParamSlice]) -> dict[SliceKey, torch.Tensor]:
        """The slices' rows of `views` (views again: no copies)."""
        return {s.key: s.view(views[s.name]) for s in slices if s.name in views}
