"""The outer optimiser of DiLoCo: SGD with Nesterov momentum over pseudo-gradients.

Written out rather than wrapping `torch.optim.SGD` because a shard owns *slices* of parameters that
arrive and are published independently, and because the published weights must be new tensors (a
pull stream in flight keeps reading the previous version untouched). The arithmetic is exactly
PyTorch's `SGD(lr=η, momentum=μ, nesterov=True, dampening=0, weight_decay=0)`:

    v ← μ·v + g            (v starts at g on the first step, as μ·0 + g)
    θ ← θ − η·(g + μ·v)

and the tests check it against torch.optim.SGD. Shards run it on the global weights; clusters run the
same code on their copy when the downlink forwards a round's contributions, so both stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

BLOCK_ELEMENTS = 1 << 18  # 1 MiB of fp32 per operand: a few operands fit a core's L2 cache

try:  # the compiled round update (setup.py builds it where a C compiler is there); else torch's operations
    from dilocox.common.wire import _kernels
except ImportError:  # pragma: no cover - depends on the install
    _kernels = None


FUSED_MAX_SOURCES = 256  # the kernel's bound on contributions (MAX_SOURCES in _kernels.c); above it, torch


@dataclass(frozen=True)
class MeanOf:
    """A round's pseudo-gradient as Σ wᵢ·sᵢ / total: `sources(start, stop)` gives each source's elements
    [start, stop) as contiguous fp32 arrays (in the order of the sum), `weights` their weights."""

    sources: Callable[[int, int], tuple]
    weights: tuple[float, ...]
    total: float


class OuterNesterov:
    def __init__(self, lr: float, momentum: float) -> None:
        if lr <= 0:
            raise ValueError(f"outer lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[Hashable, torch.Tensor] = {}

    def step(self, key: Hashable, param: torch.Tensor, grad: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Return the updated parameter. By default a new tensor, and `key`'s momentum buffer is replaced
        by a new one: a published version keeps references to its weights and momentum (no copy per
        round), which must not change while a pull streams them. `in_place`: update `param` and the
        buffer themselves (the shard, when no pull holds the version): no second copy of either."""
        flat = grad.detach().reshape(-1)
        return self.step_by_block(key, param, lambda start, stop: flat[start:stop], in_place)

    def step_by_block(
        self,
        key: Hashable,
        param: torch.Tensor,
        grad_block: Callable[[int, int], torch.Tensor],
        in_place: bool = False,
        block_elements: int = BLOCK_ELEMENTS,
        mean_of: MeanOf | None = None,
    ) -> torch.Tensor:
        """`step`, with the pseudo-gradient given block by block: `grad_block(start, stop)` returns its
        flat elements [start, stop) (it may reuse one scratch tensor; each block is used before the next
        is asked for). `block_elements`: the blocks' size (`BLOCK_ELEMENTS` unless the gradient is built
        by rows: then a whole number of them).

        Why blocks: every operation below is one pass over its operands, and a slice of 100M elements
        passed through whole makes each pass go out to memory. Blocks of `BLOCK_ELEMENTS` stay in the
        core's cache, so the seven passes (and the weighted mean's, see `aggregation.apply_round`) cost
        about one trip to memory, and the only scratch tensor is one block. Blocking changes no
        arithmetic: every operation is elementwise, so the bits are those of the whole-tensor form.

        One rounded operation at a time (no `alpha=`, which may fuse into an FMA on one machine and not
        on another): the clusters' replay must round exactly as the shard does.

        `mean_of`: the gradient as the weighted mean of sources (`MeanOf`), which the compiled kernel
        (common/wire/_kernels.c, where it was built) folds into the step in one pass per block, with the
        bits of `grad_block` and the operations below."""
        old = self.buffers.get(key)
        if not param.is_contiguous() or (old is not None and not old.is_contiguous()):
            in_place = False  # a flat view would be a copy: updating it would not update them
        flat_param = param.detach().reshape(-1)
        n = flat_param.numel()
        old_flat = None if old is None else old.reshape(-1)
        buf = old_flat if in_place and old_flat is not None else torch.empty_like(flat_param)
        out = flat_param if in_place else torch.empty_like(flat_param)
        update = torch.empty(min(n, block_elements), dtype=flat_param.dtype)
        fused = (
            mean_of is not None
            and _kernels is not None
            and len(mean_of.weights) <= FUSED_MAX_SOURCES
            and flat_param.dtype == buf.dtype == torch.float32
        )
        for start in range(0, n, block_elements):
            stop = min(n, start + block_elements)
            if fused:
                assert mean_of is not None
                _kernels.mean_step(
                    mean_of.sources(start, stop),
                    mean_of.weights,
                    mean_of.total,
                    None if old_flat is None else old_flat[start:stop].numpy(),
                    buf[start:stop].numpy(),
                    flat_param[start:stop].numpy(),
                    out[start:stop].numpy(),
                    self.lr,
                    self.momentum,
                )
                continue
            g, v, u = grad_block(start, stop), buf[start:stop], update[: stop - start]
            if old_flat is None:
                v.copy_(g)  # v starts at g
            elif in_place:
                v.mul_(self.momentum).add_(g)
            else:
                torch.mul(old_flat[start:stop], self.momentum, out=v).add_(g)
            torch.mul(v, self.momentum, out=u).add_(g).mul_(self.lr)
            if in_place:
                out[start:stop].sub_(u)
            else:
                torch.sub(flat_param[start:stop], u, out=out[start:stop])
        self.buffers[key] = buf.view(param.shape)
        return param if in_place else out.view(param.shape)

    def state_dict(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "buffers": dict(self.buffers)}

    def load_state_dict(self, state: dict) -> None:
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self.buffers = {k: v.clone() for k, v in state["buffers"].items()}
