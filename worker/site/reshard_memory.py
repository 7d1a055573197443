"""The round boundary's reshard as the memory plan counts it: the send and receive buffers each replica's
resharder keeps and the host buffer θ lands in (`reshard` and part of `exchange` in
worker/site/memory_plan.py), and which parameters each replica owns.

Its own module because it is the one part of the plan that reads another planner's output rather than
the model's shape: `ExactReshardSizing` walks every piece `StageResharder` (worker/site/reshard.py) plans,
what the site allocates; `BoundedReshardSizing` is the layout search's stand-in, the same owners with the
buffers at their bound, never below the exact figure and without planning every piece.
"""

from __future__ import annotations

import math

from dilocox.worker.site.mesh import SiteShape
from dilocox.worker.site.reshard import StageResharder, owners_by_size


class ExactReshardSizing:
    """The boundary's reshard as `StageResharder` plans it, piece by piece (what the site allocates)."""

    def __init__(
        self, specs: list[tuple[str, tuple[int, ...]]], shape: SiteShape, sharded: bool, batch_elements: int
    ) -> None:
        plan = StageResharder(dict(specs), shape, 0, sharded, batch_elements)
        self.owner = plan.owner
        self.buffers, self.landing = _reshard_buffers(plan), _landing_elements(plan)

    def owned(self, shapes: dict[str, tuple[int, ...]], replica: int) -> list[str]:
        return [n for n in shapes if self.owner[n] == replica]


class BoundedReshardSizing:
    """The layout search's reshard: the same owners, the buffers at their bound (a batch each way, never
    more than the stage) and the busiest replica's parameters for every rank — never below the exact plan,
    without planning every piece (seconds a layout at dp 160)."""

    def __init__(
        self, specs: list[tuple[str, tuple[int, ...]]], shape: SiteShape, sharded: bool, batch_elements: int
    ) -> None:
        sizes = {n: math.prod(s) for n, s in specs}
        self.owner = owners_by_size(sizes, shape.dp)
        loads = [0] * shape.dp
        for name, replica in self.owner.items():
            loads[replica] += sizes[name]
        self.busiest = max(range(shape.dp), key=lambda r: loads[r])
        stage = sum(sizes.values())
        self.buffers = [2 * min(batch_elements, stage)] * shape.dp
        self.landing = [min(batch_elements, stage)] * shape.dp

    def owned(self, shapes: dict[str, tuple[int, ...]], replica: int) -> list[str]:
        return [n for n in shapes if self.owner[n] == self.busiest]


def _landing_elements(plan: StageResharder) -> list[int]:
    """Per replica of the stage, elements of the host buffer a gather lands θ in (`Resharder.gather_rows`,
    kept for the run): the most of one batch's rows the replica owns. One pass over the plan's pieces."""
    landing = [0] * plan.shape.dp
    for pieces in plan.gather_pieces:
        into = [0] * plan.shape.dp
        for p in pieces:
            into[p.dst] += (p.stop - p.start) * plan.row_numel[p.name]
        landing = [max(a, b) for a, b in zip(landing, into)]
    return landing


def _reshard_buffers(plan: StageResharder) -> list[int]:
    """Per replica of the stage, elements of the send + receive buffers its resharder keeps: the largest
    of each over its batches, gathers and scatters (it grows them and never shrinks). One pass over the
    plan's pieces, which are the same on every replica."""
    dp = plan.shape.dp
    send, recv = [0] * dp, [0] * dp
    for pieces in plan.gather_pieces + plan.scatter_pieces:
        out, into = [0] * dp, [0] * dp
        for p in pieces:
            if p.src != p.dst:
                n = (p.stop - p.start) * plan.row_numel[p.name]
                out[p.src] += n
                into[p.dst] += n
        send = [max(a, b) for a, b in zip(send, out)]
        recv = [max(a, b) for a, b in zip(recv, into)]
    return [s + r for s, r in zip(send, recv)]
