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

from typing import Hashable

import torch


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
        buffer themselves (the shard, when no pull holds the version): no second copy of either.

        One rounded operation at a time (no `alpha=`, which may fuse into an FMA on one machine and not
        on another): the clusters' replay must round exactly as the shard does; both forms round alike."""
        buf = self.buffers.get(key)
        if buf is None:
            buf = grad.detach().clone()
        elif in_place:
            buf.mul_(self.momentum).add_(grad)
        else:
            buf = (buf * self.momentum).add_(grad)
        self.buffers[key] = buf
        update = (buf * self.momentum).add_(grad).mul_(self.lr)
        return param.sub_(update) if in_place else param - update

    def state_dict(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "buffers": dict(self.buffers)}

    def load_state_dict(self, state: dict) -> None:
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self.buffers = {k: v.clone() for k, v in state["buffers"].items()}
