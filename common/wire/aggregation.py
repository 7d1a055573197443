"""The token-weighted mean of a round's pseudo-gradients, computed identically everywhere.

Shards and clusters both run this function on the same decoded contributions: the shard to step its
global weights, each cluster to replay that step on its own copy (the compressed downlink forwards
contributions, not weights). Summing in cluster-name order with the same float operations makes the
results bit-identical, whatever order the pushes arrived in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

import torch

from dilocox.common.wire.lowrank import OrderedProduct
from dilocox.common.wire.outer_optimizer import BLOCK_ELEMENTS, MeanOf, OuterNesterov

Contribution = tuple[str, float, Callable[[], "torch.Tensor | OrderedProduct"]]  # (cluster, weight, decode)


def summed_weights(items: list[Contribution], scales: Mapping[str, float] | None = None) -> tuple[list[float], float]:
    """Each contribution's weight in the sum and the total the sum is divided by, for `items` in cluster
    order. `scales`: a cluster's clip factor (the update check's `clip`: its update merged as c·Δ at its
    full weight), so its weight in the sum is w·c while the total stays Σ w. Both computed the same way
    wherever the round is applied (w·1.0 is w: no scale, the old bits)."""
    total = 0.0
    for _, weight, _ in items:
        total += weight  # in cluster order, on the shard and in every replay
    return [weight * scales.get(cluster, 1.0) if scales else weight for cluster, weight, _ in items], total


def weighted_mean(
    contributions: Iterable[Contribution], scales: Mapping[str, float] | None = None
) -> torch.Tensor | None:
    """Σ c·w·Δ / Σ w over the contributions, in cluster order (c: `scales`, 1 where absent); decodes one
    contribution at a time and folds it in by cache-sized blocks, so the only slice-sized tensors are the
    sum and the contribution being folded in (one block of scratch for the products)."""
    items = sorted(contributions, key=lambda c: c[0])
    in_sum, total = summed_weights(items, scales)
    acc: torch.Tensor | None = None
    scratch = torch.empty(0)
    for (_, _, decode), weight in zip(items, in_sum):
        delta = _dense(decode())
        flat = delta.reshape(-1)
        n = flat.numel()
        # A multiply, then an add: `add_(delta, alpha=w)` may fuse into one FMA on some CPUs and not on
        # others, and shards and clusters must round alike (see lowrank.OrderedProduct).
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
    if acc is None:
        return None
    return acc.div_(total).view(shape)


def _dense(decoded: torch.Tensor | OrderedProduct) -> torch.Tensor:
    return (decoded.dense() if isinstance(decoded, OrderedProduct) else decoded).to(torch.float32)


def decode_by_blocks(codecs: Iterable[str]) -> bool:
    """Whether contributions in these codecs can all be held at once for free and read block by block:
    fp32 payloads decode to views of their bytes, low-rank ones to their factors (`OrderedProduct`), so
    `apply_round` fuses the mean into the step and no contribution is ever dense. Other codecs (int8,
    int4, fp16, bf16) decode whole, one at a time."""
    return all(codec in ("fp32", "lowrank") for codec in codecs)


class _BlockReader:
    """Elements [start, stop) of one decoded contribution: a view of a dense one, or the rows of a
    low-rank one built into its own block of scratch (valid until its next read)."""

    def __init__(self, decoded: torch.Tensor | OrderedProduct, block: int) -> None:
        self.product = decoded if isinstance(decoded, OrderedProduct) else None
        self.flat = None if self.product is not None else decoded.to(torch.float32).reshape(-1)
        self.scratch = torch.empty(block) if self.product is not None else None

    @property
    def numel(self) -> int:
        return self.product.rows * self.product.cols if self.product is not None else self.flat.numel()

    def read(self, start: int, stop: int) -> torch.Tensor:
        if self.product is None:
            return self.flat[start:stop]
        cols = self.product.cols  # blocks are whole rows (`apply_round` aligns them)
        out = self.scratch[: stop - start].view(-1, cols)
        return self.product.rows_into(start // cols, stop // cols, out).reshape(-1)


def apply_round(
    contributions: Iterable[Contribution],
    optimizer: OuterNesterov,
    key: Hashable,
    param: torch.Tensor,
    in_place: bool = False,
    decode_together: bool = True,
    scales: Mapping[str, float] | None = None,
) -> torch.Tensor | None:
    """The round's outer step on one slice: `optimizer.step(key, param, weighted_mean(contributions))`,
    with the same bits, block by block; None if nobody contributed to the slice. A contribution's
    decode returns a tensor or, for a low-rank payload, its `OrderedProduct` (`codecs.decode_lazy`).

    `decode_together`: take every contribution at once and fuse the weighted mean into the step's
    blocks, so no slice-sized temporary exists at all — right when holding them is free (fp32 views,
    low-rank factors: `decode_by_blocks`) or already done. Otherwise the mean is built one decoded
    contribution at a time (one slice-sized temporary, whatever the number of clusters) and only the
    step runs by blocks. `scales`: clip factors by cluster (`summed_weights`)."""
    items = sorted(contributions, key=lambda c: c[0])
    if not items:
        return None
    if not decode_together:
        grad = weighted_mean(items, scales)
        assert grad is not None
        return optimizer.step(key, param, grad, in_place=in_place)
    in_sum, total = summed_weights(items, scales)
    decoded = [(decode(), weight) for (_, _, decode), weight in zip(items, in_sum)]
    cols = {d.cols for d, _ in decoded if isinstance(d, OrderedProduct)}
    if len(cols) > 1:
        raise ValueError(f"{key}: low-rank contributions of {sorted(cols)} columns")
    # Blocks of whole rows where a low-rank contribution is built by rows (any blocking gives the same
    # bits: every operation is elementwise).
    block = max(1, BLOCK_ELEMENTS // max(cols)) * max(cols) if cols else BLOCK_ELEMENTS
    size = min(param.numel(), block)
    readers = [(_BlockReader(d, size), weight) for d, weight in decoded]
    if any(r.numel != param.numel() for r, _ in readers):
        raise ValueError(f"{key}: contributions of {[r.numel for r, _ in readers]} elements for {param.numel()}")
    acc, scaled = torch.empty(size), torch.empty(size)

    def mean_block(start: int, stop: int) -> torch.Tensor:
        # weighted_mean's operations on elements [start, stop): a multiply, then an add, per contribution
        out = acc[: stop - start]
        first, weight = readers[0]
        torch.mul(first.read(start, stop), weight, out=out)
        for reader, weight in readers[1:]:
            out.add_(torch.mul(reader.read(start, stop), weight, out=scaled[: stop - start]))
        return out.div_(total)

    mean_of = MeanOf(
        lambda start, stop: tuple(r.read(start, stop).numpy() for r, _ in readers),
        tuple(weight for _, weight in readers),
        total,
    )
    return optimizer.step_by_block(key, param, mean_block, in_place=in_place, block_elements=block, mean_of=mean_of)
