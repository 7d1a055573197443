"""The host memory of a rank's round boundary: two flat fp32 buffers over the parameters it owns.

* `start` — s_t, where the current round started (the model as the rank last wrote it);
* `work` — the exchange buffer: the gathered local weights θ, turned in place into the pseudo-gradient
  Δ = s − θ, which the background communicator compresses and pushes while the next round trains.

Both are one allocation each (page-locked where a GPU copies to and from them), with views per
parameter and per slice, so the boundary is a few large copies and in-place arithmetic — never a
dictionary of fresh per-parameter tensors. Together with the client's replica of the global weights and
the outer momentum (4 + 4 bytes), and the compressor's error-feedback residual (4), that is all a rank
keeps for the exchange: 8 + 12 bytes per owned parameter (docs/decisions.md, "The round boundary").
"""

from __future__ import annotations

import math

import torch

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.framing import SliceKey


class HostBuffers:
    def __init__(self, shapes: dict[str, tuple[int, ...]], pinned: bool = False) -> None:
        self.shapes = dict(shapes)
        self.numel = sum(math.prod(s) for s in self.shapes.values())
        flat = lambda: torch.empty(self.numel, dtype=torch.float32, pin_memory=pinned)  # noqa: E731
        self._start, self._work = flat(), flat()
        self.start = self._views(self._start)
        self.work = self._views(self._work)
        self.pinned = pinned

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views, offset = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            views[name] = flat[offset : offset + n].view(shape)
            offset += n
        return views

    @property
    def nbytes(self) -> int:
        return self._start.nbytes + self._work.nbytes

    @staticmethod
    def slices_of(views: dict[str, torch.Tensor], slices: list[ParamSlice]) -> dict[SliceKey, torch.Tensor]:
        """The slices' rows of `views` (views again: no copies)."""
        return {s.key: s.view(views[s.name]) for s in slices if s.name in views}
