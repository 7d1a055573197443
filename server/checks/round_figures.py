"""What a shard's update check computes per round (server/checks/update_check.py judges from it), on the slices it
owns: of the Gram G of the sites' updates (G_ij = ⟨Δ_i, Δ_j⟩, summed over slices) only what the verdicts
use — its diagonal, and G w, wᵀ G w for the weights the check picks — plus each update's product with the
previous global update U = Σ_b w_b y_b and ‖U‖², from the payloads as they came (a low-rank one through
its factors, never its product).

Why its own module, and why so careful about cost: these figures are formed in the round's close, after the
last push and before any site can pull. The whole G is sites² × elements: at 256 sites forming it (and the
products with every previous contribution) was most of the close, 235–400 ms of a shard's core. Over a
dense slice the check needs none of it: ⟨Δ_i, Σ_j w_j Δ_j⟩ and ⟨Δ_i, U⟩ are a weighted sum and a dot per
site, sites × elements, in float64 (exact products of fp32 values summed; the check takes a site's own term
back out of G w, which in fp32 could cancel to noise). A slice with a low-rank update goes through the
Gram of the factors (`gram`: a few BLAS calls, sites as rows), which is rank² × (rows + cols) per pair.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dilocox.common.wire.lowrank import OrderedProduct


def _factors_or_dense(decoded: torch.Tensor | OrderedProduct) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    if isinstance(decoded, OrderedProduct):
        return decoded.factors()
    return decoded.reshape(decoded.shape[0], -1) if decoded.dim() >= 2 else decoded.reshape(1, -1)


def inner(a, b) -> float:  # noqa: ANN001
    """⟨A, B⟩ for dense matrices or (P, Qᵀ) factor pairs, without forming a low-rank product:
    ⟨P₁Q₁ᵀ, P₂Q₂ᵀ⟩ = Σ (P₁ᵀP₂) ∘ (Q₁ᵀQ₂); ⟨PQᵀ, D⟩ = Σ P ∘ (D Q)."""
    if isinstance(a, tuple) and isinstance(b, tuple):  # small products: in float64, no overflow of huge factors
        (p1, qt1), (p2, qt2) = a, b
        return float(((p1.double().T @ p2.double()) * (qt1.double() @ qt2.double().T)).sum())
    if isinstance(a, tuple) or isinstance(b, tuple):
        (p, qt), dense = (a, b) if isinstance(a, tuple) else (b, a)
        return float((p.double() * (dense @ qt.T).double()).sum())
    # Dense slices in fp32 (no float64 copy of a model-sized slice): values large enough to overflow it are
    # a fault already, and a non-finite figure is flagged as one (`UpdateCheck.review`).
    return float(torch.dot(a.reshape(-1), b.reshape(-1)))


GRAM_PIECE_BYTES = 64 * 2**20  # the stacked pieces a Gram is formed from, at most (the sites' own tensors aside)


def gram(xs: list, ys: list | None = None, scratch: GramScratch | None = None) -> torch.Tensor:
    """[⟨x_i, y_j⟩] (float64, len(xs) × len(ys); ys = xs: the symmetric Gram) with the arithmetic of `inner`,
    in a few BLAS calls per slice instead of one Python call per pair — the pairs grow as sites², and at
    128 sites the pairwise loop was most of a shard's CPU. Factor pairs (P, Qᵀ): the sites' factors side by
    side, (PₓᵀP_y) ∘ (QₓᵀQ_y) in float64, summed per site block by `index_add_` (no multiplication by the
    zeros of an indicator matrix, which would spread one site's NaN to every entry); dense ones: fp32
    products of the sites' updates as rows. Both are formed over pieces of at most `GRAM_PIECE_BYTES`, so
    hundreds of sites never stack a slice hundreds of times. A pair of a dense and a factor update (a
    flush's int8 beside low-rank ones) goes through `inner`. `scratch`: pieces reused across calls."""
    symmetric = ys is None
    ys = xs if ys is None else ys
    out = torch.zeros(len(xs), len(ys), dtype=torch.float64)
    fx = [i for i, x in enumerate(xs) if isinstance(x, tuple)]
    fy = [j for j, y in enumerate(ys) if isinstance(y, tuple)]
    dx = [i for i, x in enumerate(xs) if not isinstance(x, tuple)]
    dy = [j for j, y in enumerate(ys) if not isinstance(y, tuple)]
    if fx and fy:
        out[torch.tensor(fx)[:, None], torch.tensor(fy)] = _factor_gram(
            [xs[i] for i in fx], [ys[j] for j in fy], symmetric
        )
    if dx and dy:
        dense = _dense_products(
            [xs[i].reshape(-1) for i in dx], [ys[j].reshape(-1) for j in dy], symmetric, scratch or GramScratch()
        )
        out[torch.tensor(dx)[:, None], torch.tensor(dy)] = dense.double()
    for i, j in [(i, j) for i in fx for j in dy] + [(i, j) for i in dx for j in fy]:
        out[i, j] = inner(xs[i], ys[j])
    if symmetric:  # exactly symmetric, as the pairwise form was
        out = torch.triu(out) + torch.triu(out, 1).T
    return out


def _products(xs: list[torch.Tensor], ys: list[torch.Tensor], same: bool, dtype: torch.dtype) -> torch.Tensor:
    """Xᵀ Y for X = [x₁ … xₙ], Y = [y₁ … yₘ] side by side (each n_rows × its own width), accumulated over
    pieces of rows so that no piece of X or Y exceeds `GRAM_PIECE_BYTES`."""
    width_x, width_y = sum(x.shape[1] for x in xs), sum(y.shape[1] for y in ys)
    size = torch.finfo(dtype).bits // 8
    step = max(1, GRAM_PIECE_BYTES // (size * max(width_x, width_y, 1)))
    total = torch.zeros(width_x, width_y, dtype=dtype)
    for start in range(0, xs[0].shape[0], step):
        px = torch.cat([x[start : start + step].to(dtype) for x in xs], dim=1)
        py = px if same else torch.cat([y[start : start + step].to(dtype) for y in ys], dim=1)
        total += px.T @ py
    return total


class GramScratch:
    """The pieces `_dense_products` copies the sites' rows into, reused by the Grams of one round's figures:
    fresh pages cost more than the copy into them (22 ms against 5 for 256 sites × 32,768 elements)."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def rows(self, which: str, count: int, width: int) -> torch.Tensor:
        flat = self._flat.get(which)
        if flat is None or flat.numel() < count * width:
            flat = self._flat[which] = torch.empty(count * width)
        return flat[: count * width].view(count, width)


def _dense_products(xs: list[torch.Tensor], ys: list[torch.Tensor], same: bool, scratch: GramScratch) -> torch.Tensor:
    """X Yᵀ in fp32 for X, Y with one site's flattened update per row, accumulated over pieces of elements so
    that no piece of X or Y exceeds `GRAM_PIECE_BYTES`. Rows, not columns side by side: a site's elements
    are copied into one reused row at memory speed, where a column of a side-by-side matrix is a strided
    scatter that took longer than the product itself (25 ms against 16 for 128 sites × 32,768 elements)."""
    numel = xs[0].numel()
    step = max(1, min(numel, GRAM_PIECE_BYTES // (4 * max(len(xs), len(ys)))))
    piece_x = scratch.rows("x", len(xs), step)
    piece_y = piece_x if same else scratch.rows("y", len(ys), step)
    total = torch.zeros(len(xs), len(ys))
    for start in range(0, numel, step):
        width = min(step, numel - start)
        for piece, rows in ((piece_x, xs), *(() if same else ((piece_y, ys),))):
            for i, row in enumerate(rows):
                piece[i, :width].copy_(row[start : start + width])
        total += piece_x[:, :width] @ piece_y[:, :width].T
    return total


def _factor_gram(
    xs: list[tuple[torch.Tensor, torch.Tensor]], ys: list[tuple[torch.Tensor, torch.Tensor]], same: bool
) -> torch.Tensor:
    left = _products([p for p, _ in xs], [p for p, _ in ys], same, torch.float64)  # PₓᵀP_y, rank by rank
    right = _products([qt.T for _, qt in xs], [qt.T for _, qt in ys], same, torch.float64)  # QₓᵀQ_y
    terms = left * right  # every site's components against every other's: summed per pair of sites below
    site_x = torch.repeat_interleave(torch.arange(len(xs)), torch.tensor([p.shape[1] for p, _ in xs]))
    site_y = torch.repeat_interleave(torch.arange(len(ys)), torch.tensor([p.shape[1] for p, _ in ys]))
    rows = torch.zeros(len(xs), terms.shape[1], dtype=torch.float64).index_add_(0, site_x, terms)
    return torch.zeros(len(xs), len(ys), dtype=torch.float64).index_add_(1, site_y, rows)


@dataclass
class RoundFigures:
    """Of one round on one shard, summed over its slices: each update's ‖Δ_i‖² (G's diagonal) and product with
    the previous global update U, and ‖U‖²; the rest of G only as `weighted` forms it, for the weights the
    check picks from the norms."""

    clusters: list[str]
    sq_norms: torch.Tensor  # float64, G_ii
    with_previous: torch.Tensor  # float64, ⟨Δ_i, U⟩, U the previous round's weighted sum of contributions
    previous_sq: float  # ‖U‖²
    contribution_digests: dict[str, bytes] = field(default_factory=dict)  # cluster -> digest of all its payloads here
    contributions: Mapping = field(default_factory=dict, repr=False)  # the round's (slice -> {cluster: Contribution})
    low_rank_gram: torch.Tensor | None = None  # float64 G over the slices where some update is low-rank, formed whole

    def weighted(self, w: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(G w, wᵀ G w) for float64 site weights `w`: over a dense slice through S = Σ_j w_j Δ_j in float64
        (sites × elements, where G is sites² × elements), over low-rank ones from their Gram. A site of zero
        weight is left out of S entirely (its update may be non-finite: 0 · inf would spread to every site's
        figure); its own entry of G w is whatever its update makes it."""
        gw, wgw = torch.zeros(len(self.clusters), dtype=torch.float64), 0.0
        index = {c: i for i, c in enumerate(self.clusters)}
        for key in sorted(self.contributions):
            xs, at = _slice_updates(self.contributions[key], index)
            if not _all_dense(xs):  # in `low_rank_gram`
                continue
            s = _weighted_sum([(float(w[i]), x) for i, x in zip(at.tolist(), xs) if w[i] != 0])
            if s is not None:
                gw[at] += _dots(xs, s)
                wgw += float(torch.dot(s, s))
        if self.low_rank_gram is not None:
            nz = torch.nonzero(w).flatten()
            gw += self.low_rank_gram[:, nz] @ w[nz]
            wgw += float(w[nz] @ self.low_rank_gram[nz][:, nz] @ w[nz])
        return gw, wgw


def round_figures(
    contributions: Mapping, previous: Mapping | None = None, skip: frozenset[str] = frozenset()
) -> RoundFigures:
    """`contributions`: slice -> {cluster: Contribution} (server/rounds/round_state.py) of the round being closed;
    `previous`: the same of the round before (what the published version forwards for replay), if any,
    less the sites in `skip` (flagged then: in warn mode a merged faulty update must not become the
    reference the honest ones are measured against). Slice by slice, one at a time (a dense U is one slice's
    size, in float64): where every update is dense, norms and products with U = Σ_b w_b y_b directly —
    sites × elements; where one is low-rank, through the Gram of factors (`gram`), never forming a product."""
    previous = previous or {}
    clusters = sorted({c for per_key in contributions.values() for c in per_key})
    index = {c: i for i, c in enumerate(clusters)}
    n = len(clusters)
    sq, with_prev, prev_sq = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), 0.0
    low_rank: torch.Tensor | None = None
    scratch = GramScratch()
    for key in sorted(set(contributions) | set(previous)):
        before = [
            (c.weight, _factors_or_dense(c.slice.decode_lazy()))
            for site, c in sorted(previous.get(key, {}).items())
            if site not in skip
        ]
        u = _weighted_sum(before) if before and _all_dense([y for _, y in before]) else None
        w_before = torch.tensor([weight for weight, _ in before], dtype=torch.float64)
        if u is not None:
            prev_sq += float(torch.dot(u, u))
        elif before:
            prev_sq += float(w_before @ gram([y for _, y in before], scratch=scratch) @ w_before)
        if key not in contributions:
            continue
        xs, at = _slice_updates(contributions[key], index)
        dense = _all_dense(xs)
        if dense:
            sq[at] += _dots(xs)
        else:
            block = gram(xs, scratch=scratch)
            low_rank = torch.zeros(n, n, dtype=torch.float64) if low_rank is None else low_rank
            low_rank[at[:, None], at] += block
            sq[at] += block.diagonal()
        if dense and u is not None:
            with_prev[at] += _dots(xs, u)
        elif before:
            with_prev[at] += gram(xs, [y for _, y in before], scratch=scratch) @ w_before
    return RoundFigures(
        clusters, sq, with_prev, prev_sq, _site_digests(contributions, clusters), contributions, low_rank
    )


def _slice_updates(per_cluster: Mapping, index: Mapping[str, int]) -> tuple[list, torch.Tensor]:
    """A slice's updates in site order, each dense or as its factors (`_factors_or_dense`), and their sites'
    positions in the round's figures."""
    ordered = sorted(per_cluster.items())
    return [_factors_or_dense(c.slice.decode_lazy()) for _, c in ordered], torch.tensor([index[c] for c, _ in ordered])


def _all_dense(updates: list) -> bool:
    return not any(isinstance(x, tuple) for x in updates)


def _weighted_sum(terms: list[tuple[float, torch.Tensor]]) -> torch.Tensor | None:
    """Σ w·x over dense updates, flattened, in float64 (None for no terms)."""
    total = None
    for weight, x in terms:
        x = x.reshape(-1)
        total = x.to(torch.float64, copy=True).mul_(weight) if total is None else total.add_(x, alpha=weight)
    return total


def _dots(xs: list[torch.Tensor], y: torch.Tensor | None = None) -> torch.Tensor:
    """[⟨x_i, y⟩] in float64 (y float64, flattened), or [‖x_i‖²] when y is None."""
    out = torch.empty(len(xs), dtype=torch.float64)
    row = torch.empty(xs[0].numel(), dtype=torch.float64) if xs else None  # one buffer: fresh pages per site cost more
    for i, x in enumerate(xs):
        row.copy_(x.reshape(-1))
        out[i] = torch.dot(row, row if y is None else y)
    return out


def _site_digests(contributions: Mapping, sites: list[str]) -> dict[str, bytes]:
    """Per site, SHA-256 over its payloads' digests in slice order: its whole contribution here, byte for byte
    (the check's `replayed`)."""
    digests = {site: hashlib.sha256() for site in sites}
    for key in sorted(contributions):
        for site, contribution in sorted(contributions[key].items()):
            if site in digests:
                digests[site].update(contribution.slice.sha256)
    return {site: d.digest() for site, d in digests.items()}
