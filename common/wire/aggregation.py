"""The token-weighted mean of a round's pseudo-gradients, computed identically everywhere.

Shards and clusters both run this function on the same decoded contributions: the shard to step its
global weights, each cluster to replay that step on its own copy (the compressed downlink forwards
contributions, not weights). Summing in cluster-name order with the same float operations makes the
results bit-identical, whatever order the pushes arrived in.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable

import torch

from dilocox.common.wire.outer_optimizer import BLOCK_ELEMENTS, OuterNesterov

Contribution = tuple[str, float, Callable[[], torch.Tensor]]  # (cluster, weight, decode)


def weighted_mean(contributions: Iterable[Contribution]) -> torch.Tensor | None:
    """Σ w·Δ / Σ w over the contributions, in cluster order; decodes one contribution at a time and
    folds it in by cache-sized blocks, so the only slice-sized tensors are the sum and the contribution
    being folded in (one block of scratch for the products)."""
    total = 0.0
    acc: torch.Tensor | None = None
    scratch = torch.empty(0)
    for _, weight, decode in sorted(contributions, key=lambda c: c[0]):
        delta = decode().to(torch.float32)
        flat = delta.reshape(-1)
        n = flat.numel()
        # A multiply, then an add: `add_(delta, alpha=w)` may fuse into one FMA on some CPUs and not on
        # others, and shards and clusters must round alike (see lowrank.ordered_product).
        if acc is None:
            acc = torch.empty_like(flat)
            for start in range(0, n, BLOCK_ELEMENTS):
                stop = min(n, start + BLOCK_ELEMENTS)
                torch.mul(flat[start:stop], weight, out=acc[start:stop])
            shape = delta.shape
        else:
            if flat.numel() != acc.numel():
                raise ValueError(f"contributions of {acc.numel()} and {flat.numel()} elements cannot be averaged")
            if scratch.numel() < min(n, BLOCK_ELEMENTS):
                scratch = torch.empty(min(n, BLOCK_ELEMENTS))
            for start in range(0, n, BLOCK_ELEMENTS):
                stop = min(n, start + BLOCK_ELEMENTS)
                acc[start:stop].add_(torch.mul(flat[start:stop], weight, out=scratch[: stop - start]))
        del delta, flat  # before the next decode: never two contributions decoded at once
        total += weight
    if acc is None:
        return None
    return acc.div_(total).view(shape)


def decode_to_views(codecs: Iterable[str]) -> bool:
    """Whether contributions in these codecs decode to views of their payload bytes (fp32), so that
    `apply_round` can decode them all at once for free and fuse the mean into the step."""
    return all(codec == "fp32" for codec in codecs)


def apply_round(
    contributions: Iterable[Contribution],
    optimizer: OuterNesterov,
    key: Hashable,
    param: torch.Tensor,
    in_place: bool = False,
    decode_together: bool = True,
) -> torch.Tensor | None:
    """The round's outer step on one slice: `optimizer.step(key, param, weighted_mean(contributions))`,
    with the same bits, block by block; None if nobody contributed to the slice.

    `decode_together`: decode every contribution first and fuse the weighted mean into the step's
    blocks, so no slice-sized temporary exists at all — right when decoding is free (fp32 payloads
    decode to views of their bytes) or already done (a cluster's replay). Otherwise the mean is built
    one decoded contribution at a time (one slice-sized temporary, whatever the number of clusters)
    and only the step runs by blocks."""
    items = sorted(contributions, key=lambda c: c[0])
    if not items:
        return None
    if not decode_together:
        grad = weighted_mean(items)
        assert grad is not None
        return optimizer.step(key, param, grad, in_place=in_place)
    flats = [(decode().to(torch.float32).reshape(-1), weight) for _, weight, decode in items]
    if any(flat.numel() != param.numel() for flat, _ in flats):
        raise ValueError(f"{key}: contributions of {[f.numel() for f, _ in flats]} elements for {param.numel()}")
    total = 0.0
    for _, weight in flats:
        total += weight  # the same order of additions as weighted_mean
    size = min(param.numel(), BLOCK_ELEMENTS)
    acc, scaled = torch.empty(size), torch.empty(size)

    def mean_block(start: int, stop: int) -> torch.Tensor:
        # weighted_mean's operations on elements [start, stop): a multiply, then an add, per contribution
        block = acc[: stop - start]
        torch.mul(flats[0][0][start:stop], flats[0][1], out=block)
        for flat, weight in flats[1:]:
            block.add_(torch.mul(flat[start:stop], weight, out=scaled[: stop - start]))
        return block.div_(total)

    return optimizer.step_by_block(key, param, mean_block, in_place=in_place)
