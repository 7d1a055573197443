"""What a shard's update check computes per round (server/update_check.py judges from it): the Gram G of the
sites' updates on the slices it owns (G_ij = ⟨Δ_i, Δ_j⟩, summed over slices), each update's products with
the previous round's contributions, and ‖U‖² of the previous global update U = Σ_b w_b y_b — from the
payloads as they came (a low-rank one through its factors), never forming U or a low-rank product.

Why its own module, and why so careful about cost: the Gram is sites² × elements, formed in the round's
close, after the last push and before any site can pull — at 256 sites it is most of the close. So it is
formed in a few BLAS calls per slice (sites as rows of a reused piece), and the previous round's Gram, which
‖U‖² needs, is the one that round's own figures already formed, whenever they were of exactly the
contributions it forwards (`reuse`): only the products of this round's updates are new.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping

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
        out[torch.tensor(fx)[:, None], torch.tensor(fy)] = _factor_gram([xs[i] for i in fx], [ys[j] for j in fy], symmetric)
    if dx and dy:
        dense = _dense_products([xs[i].reshape(-1) for i in dx], [ys[j].reshape(-1) for j in dy], symmetric, scratch or GramScratch())
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


def _factor_gram(xs: list[tuple[torch.Tensor, torch.Tensor]], ys: list[tuple[torch.Tensor, torch.Tensor]], same: bool) -> torch.Tensor:
    left = _products([p for p, _ in xs], [p for p, _ in ys], same, torch.float64)  # PₓᵀP_y, rank by rank
    right = _products([qt.T for _, qt in xs], [qt.T for _, qt in ys], same, torch.float64)  # QₓᵀQ_y
    terms = left * right  # every site's components against every other's: summed per pair of sites below
    site_x = torch.repeat_interleave(torch.arange(len(xs)), torch.tensor([p.shape[1] for p, _ in xs]))
    site_y = torch.repeat_interleave(torch.arange(len(ys)), torch.tensor([p.shape[1] for p, _ in ys]))
    rows = torch.zeros(len(xs), terms.shape[1], dtype=torch.float64).index_add_(0, site_x, terms)
    return torch.zeros(len(xs), len(ys), dtype=torch.float64).index_add_(1, site_y, rows)


@dataclass
class RoundFigures:
    """G and the products with the previous update of one round on one shard, summed over its slices."""

    clusters: list[str]
    gram: torch.Tensor  # float64, clusters × clusters
    with_previous: torch.Tensor  # float64, ⟨Δ_i, U⟩, U the previous round's weighted sum of contributions
    previous_sq: float  # ‖U‖²
    contribution_digests: dict[str, bytes] = field(default_factory=dict)  # cluster -> digest of all its payloads here


def round_figures(contributions: Mapping, previous: Mapping | None = None, skip: frozenset[str] = frozenset(),
                  reuse: RoundFigures | None = None) -> RoundFigures:  # fmt: skip
    """`contributions`: slice -> {cluster: Contribution} (server/round_state.py) of the round being closed;
    `previous`: the same of the round before (what the published version forwards for replay), if any,
    less the sites in `skip` (flagged then: in warn mode a merged faulty update must not become the
    reference the honest ones are measured against); `reuse`: the previous round's own figures."""
    clusters = sorted({c for per_key in contributions.values() for c in per_key})
    index = {c: i for i, c in enumerate(clusters)}
    n = len(clusters)
    gram_sum, with_prev = torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    scratch = GramScratch()
    for key in sorted(contributions):
        ordered = sorted(contributions[key].items())
        at = torch.tensor([index[c] for c, _ in ordered])
        xs = [_factors_or_dense(contribution.slice.decode_lazy()) for _, contribution in ordered]
        gram_sum[at[:, None], at] += gram(xs, scratch=scratch)
        before = [(c.weight, _factors_or_dense(c.slice.decode_lazy())) for site, c in sorted((previous or {}).get(key, {}).items())
                  if site not in skip]  # fmt: skip
        if before:
            w = torch.tensor([weight for weight, _ in before], dtype=torch.float64)
            with_prev[at] += gram(xs, [y for _, y in before], scratch=scratch) @ w
    prev_sq = _previous_sq(previous or {}, skip, reuse, scratch)
    return RoundFigures(clusters, gram_sum, with_prev, prev_sq, _site_digests(contributions, clusters))


def _site_digests(contributions: Mapping, sites: list[str]) -> dict[str, bytes]:
    """Per site, SHA-256 over its payloads' digests in slice order: its whole contribution here, byte for byte
    (the check's `replayed`, and what tells `_reused_gram` that a round's figures were of these payloads)."""
    digests = {site: hashlib.sha256() for site in sites}
    for key in sorted(contributions):
        for site, contribution in sorted(contributions[key].items()):
            if site in digests:
                digests[site].update(contribution.slice.sha256)
    return {site: d.digest() for site, d in digests.items()}


def _previous_sq(previous: Mapping, skip: frozenset[str], reuse: RoundFigures | None, scratch: GramScratch) -> float:
    """‖U‖², U = Σ_b w_b y_b over the previous round's contributions less `skip`: wᵀ G w with G that round's Gram
    summed over slices (a site's weight is the same on all its slices; a slice it did not send adds zeros)."""
    sites = sorted({site for per_key in previous.values() for site in per_key if site not in skip})
    if not sites:
        return 0.0
    weights = {site: c.weight for per_key in previous.values() for site, c in per_key.items()}
    w = torch.tensor([weights[site] for site in sites], dtype=torch.float64)
    g = _reused_gram(previous, sites, reuse)
    if g is None:
        index = {site: i for i, site in enumerate(sites)}
        g = torch.zeros(len(sites), len(sites), dtype=torch.float64)
        for key in sorted(previous):
            ordered = [(site, c) for site, c in sorted(previous[key].items()) if site in index]
            if ordered:
                at = torch.tensor([index[site] for site, _ in ordered])
                g[at[:, None], at] += gram([_factors_or_dense(c.slice.decode_lazy()) for _, c in ordered], scratch=scratch)
    return float(w @ g @ w)


def _reused_gram(previous: Mapping, sites: list[str], reuse: RoundFigures | None) -> torch.Tensor | None:
    """`sites`' block of the previous round's own Gram, if its figures were of exactly these payloads: each
    site's digest over its payloads here equal to the one they recorded. Else None (no figures then: a
    restarted shard, a round closed without the check)."""
    if reuse is None or not set(sites) <= set(reuse.contribution_digests):
        return None
    digests = _site_digests(previous, sites)
    if any(digests[site] != reuse.contribution_digests[site] for site in sites):
        return None
    position = {c: i for i, c in enumerate(reuse.clusters)}
    at = torch.tensor([position[site] for site in sites])
    return reuse.gram[at[:, None], at]
