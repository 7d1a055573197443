"""How the round loop reaches the parameters it exchanges, wherever the trainer keeps them.

The round loop (`cluster.DilocoCluster`) works on host-side fp32 tensors of the parameters *this rank*
pushes and pulls — its `names` — and needs three things from the trainer's side: read the current
values of those names into host tensors, write new values of them back into the model (everywhere they
are held), and, in a site of several ranks, agree with the other ranks on the few decisions that keep
their collectives in step (the round to train, whether to rejoin). One process has all names and agrees
with itself (`LocalAccess`); a rank of a torchrun site owns a share of its stage and moves rows between
FSDP's layout and its own over the stage's dp group (`worker/site/access.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dilocox.worker.exchange.host_buffers import host_empty

# `land(name, first_row, last_row, rows)`: rows [first_row, last_row) of parameter `name`, flat, fp32 on the
# host, valid only during the call (it may be the parameter itself: read them, never write them).
Land = Callable[[str, int, int, torch.Tensor], None]
HOST_CHUNK_ELEMENTS = 16 * 2**20  # a device's rows reach the host in pieces of at most 64 MB


class ParameterAccess(Protocol):
    names: list[str]  # what this rank pushes and pulls, in the model's order
    shapes: dict[str, tuple[int, ...]]  # of `names`: full shapes
    model_specs: list[tuple[str, tuple[int, ...]]]  # the whole model's (name, shape), for Join
    params_held: int  # elements this rank's trainer holds (its shard of its stage)
    pinned: bool  # whether host buffers should be page-locked (a CUDA device copies to and from them)

    def read(self, out: dict[str, torch.Tensor]) -> None:
        """The current values of `names` into `out` (fp32 host tensors). Collective in a site."""

    def read_rows(self, land: Land, keep_buffer: bool = True) -> None:
        """The current values of `names`, handed to `land` piece by piece (every row of every name once),
        so the caller can fold them into what it keeps without a model-sized buffer. Collective in a site.
        `keep_buffer=False`: the bounded host buffer the pieces land in is freed afterwards, not kept for
        the next boundary (a lean site: `spill_dir`)."""

    def write(self, values: dict[str, torch.Tensor]) -> None:
        """`values` of `names` into the model, wherever they are held. Collective in a site."""

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the site's ranks."""

    def agree_max(self, value: int) -> int:
        """The largest `value` over the site's ranks."""

    def agree_any(self, flag: bool) -> bool:
        """Whether any rank of the site says `flag`."""


class LocalAccess:
    """A trainer whose whole model is in this process (one device)."""

    def __init__(self, named_parameters: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.params = dict(named_parameters)
        self.names = list(self.params)
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.model_specs = list(self.shapes.items())
        self.params_held = sum(p.numel() for p in self.params.values())
        self.pinned = any(p.device.type == "cuda" for p in self.params.values()) and torch.cuda.is_available()

    @torch.no_grad()
    def read(self, out: dict[str, torch.Tensor]) -> None:
        for name, p in self.params.items():
            out[name].copy_(p.detach(), non_blocking=True)
        if self.pinned:
            torch.cuda.synchronize()

    @torch.no_grad()
    def read_rows(self, land: Land, keep_buffer: bool = True) -> None:
        """A host parameter is handed over as it is; a device one through one bounded host buffer, in row
        pieces of at most `HOST_CHUNK_ELEMENTS` (or one row, where a row is larger)."""
        on_device = [(n, p) for n, p in self.params.items() if p.device.type != "cpu"]
        rows_of = {n: (p.shape[0] if p.dim() else 1) for n, p in self.params.items()}
        per_row = {n: max(1, p.numel() // max(1, rows_of[n])) for n, p in self.params.items()}
        limit = max([HOST_CHUNK_ELEMENTS, *(per_row[n] for n, _ in on_device)])
        size = min(limit, max((p.numel() for _, p in on_device), default=0))
        staging = host_empty(size, self.pinned) if on_device else None
        for name, p in self.params.items():
            flat, rows, width = p.detach().reshape(-1), rows_of[name], per_row[name]
            if staging is None or flat.device.type == "cpu":
                land(name, 0, rows, flat)
                continue
            step = max(1, limit // width)
            for first in range(0, rows, step):
                last = min(rows, first + step)
                part = staging[: (last - first) * width]
                part.copy_(flat[first * width : last * width])
                land(name, first, last, part)

    @torch.no_grad()
    def write(self, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            self.params[name].copy_(value, non_blocking=True)
        if self.pinned:
            torch.cuda.synchronize()

    def agree_min(self, value: int) -> int:
        return value

    def agree_max(self, value: int) -> int:
        return value

    def agree_any(self, flag: bool) -> bool:
        return flag
