"""The shards' update check (server/checks/update_check.py): figures from the payloads as they came, verdicts per
site."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.server.checks.round_figures import inner, round_figures
from dilocox.server.checks.update_check import UpdateCheck, UpdateCheckConfig
from dilocox.server.rounds.round_state import Contribution

KEYS = [SliceKey("w", 0, 48), SliceKey("b", 0, 32)]
SHAPES = {KEYS[0]: (48, 40), KEYS[1]: (32,)}


def encoded(key: SliceKey, tensor: torch.Tensor, compressor: TensorCompressor | None) -> EncodedSlice:
    if compressor is None:
        return EncodedSlice.exact(key, tensor)
    e = compressor.compress(key, tensor)
    return EncodedSlice(key, e.codec, e.dtype, tuple(e.shape), bytearray(e.payload))


def test_inner_products_through_low_rank_factors_equal_the_dense_ones():
    g = torch.Generator().manual_seed(0)
    lowrank = TensorCompressor(
        CompressionConfig(rank_max=4, target_energy=0.99, min_lowrank_numel=16, error_feedback=False), seed=1
    )
    a, b = torch.randn(48, 40, generator=g), torch.randn(48, 40, generator=g)
    ea, eb = encoded(KEYS[0], a, lowrank), encoded(KEYS[0], b, lowrank)
    assert ea.codec == "lowrank"
    da, db = ea.decode(), eb.decode()
    fa, fb = ea.decode_lazy().factors(), eb.decode_lazy().factors()
    for x, y, want in (
        (fa, fb, (da * db).sum()),
        (fa, db, (da * db).sum()),
        (da, fb, (da * db).sum()),
        (fa, fa, (da * da).sum()),
    ):
        assert inner(x, y) == pytest.approx(float(want), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("piece_bytes", [64 * 2**20, 512])
def test_the_gram_of_many_sites_is_the_pairwise_inner_products_and_keeps_a_nan_to_its_site(piece_bytes, monkeypatch):
    """The shard's figures in a few BLAS calls per slice (sites² pairs were most of its CPU at 128 sites):
    low-rank factors of different ranks, dense updates and the mixed pairs, against `inner` pair by pair —
    formed whole, and over pieces of a few rows (what bounds its memory with hundreds of sites)."""
    from dilocox.server.checks import round_figures as figures_module
    from dilocox.server.checks.round_figures import gram

    monkeypatch.setattr(figures_module, "GRAM_PIECE_BYTES", piece_bytes)

    g = torch.Generator().manual_seed(3)
    factors = [(torch.randn(24, r, generator=g), torch.randn(r, 20, generator=g)) for r in (1, 3, 4, 2)]
    dense = [torch.randn(24, 20, generator=g) for _ in range(3)]
    xs = [factors[0], dense[0], factors[1], factors[2], dense[1]]
    ys = [dense[2], factors[3], factors[0]]
    for got, (left, right) in ((gram(xs), (xs, xs)), (gram(xs, ys), (xs, ys))):
        want = torch.tensor([[inner(x, y) for y in right] for x in left], dtype=torch.float64)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()
    assert torch.equal(gram(xs), gram(xs).T)
    poisoned = list(xs)
    p, qt = factors[1]
    poisoned[2] = (p.clone().index_fill_(1, torch.tensor([0]), float("nan")), qt)
    figures = gram(poisoned)
    finite = torch.isfinite(figures)
    assert not finite[2].any() and not finite[:, 2].any()
    assert finite[[0, 1, 3, 4]][:, [0, 1, 3, 4]].all()  # the other sites' figures stay


class Round:
    """Four (or `n`) sites' pseudo-gradients: a shared direction plus each site's own noise, as IID data gives."""

    def __init__(self, n: int = 4, seed: int = 0, lowrank: bool = True) -> None:
        self.n, self.g = n, torch.Generator().manual_seed(seed)
        config = CompressionConfig(rank_max=4, target_energy=0.9, min_lowrank_numel=16, error_feedback=False)
        self.compressors = [TensorCompressor(config, seed=i) if lowrank else None for i in range(n)]
        self.base = {k: self._direction(k) for k in KEYS}

    def _direction(self, k: SliceKey) -> torch.Tensor:
        if len(SHAPES[k]) == 2:
            return torch.randn(SHAPES[k][0], 3, generator=self.g) @ torch.randn(3, SHAPES[k][1], generator=self.g)
        return torch.randn(SHAPES[k], generator=self.g)

    def contributions(
        self, faults: dict[int, str | float] | None = None, replay: dict | None = None
    ) -> tuple[dict, dict]:
        faults = faults or {}
        # Pseudo-gradients are close to low rank (what the low-rank codec relies on) and the direction of
        # training persists from round to round: a rank-3 shared part, most of it the same every round.
        common = {k: self.base[k] + 0.5 * self._direction(k) for k in KEYS}
        out: dict = {k: {} for k in KEYS}
        for i in range(self.n):
            cluster = f"site{i}"
            for k in KEYS:
                delta = common[k] + 0.3 * torch.randn(SHAPES[k], generator=self.g)
                kind = faults.get(i)
                if kind == "scale":
                    delta = 100 * delta
                elif isinstance(kind, float):  # a site whose update is this many times an honest one's
                    delta = kind * delta
                elif kind == "sign":
                    delta = -delta
                elif kind == "noise":
                    delta = torch.randn(SHAPES[k], generator=self.g) * delta.norm() / (delta.numel() ** 0.5)
                e = replay[cluster][k] if kind == "replay" else encoded(k, delta, self.compressors[i])
                out[k][cluster] = Contribution(cluster, 100.0, e)
        return out, {f"site{i}": 100.0 for i in range(self.n)}


def review(check: UpdateCheck, contributions: dict, weights: dict, previous: dict | None = None) -> dict:
    """`weights`: the round's tokens, as `Round.contributions` returns them — the check gives each site one vote."""
    return {v.cluster: v for v in check.review(round_figures(contributions, previous, check.last_flagged))}


def _pairwise(
    contributions: dict, previous: dict, skip: frozenset[str]
) -> tuple[list[str], torch.Tensor, torch.Tensor, float]:
    """The figures the slow way, pair by pair through `inner`: G, ⟨Δ_i, U⟩ and ‖U‖² (U without `skip`)."""
    from dilocox.server.checks.round_figures import _factors_or_dense

    sites = sorted({c for per in contributions.values() for c in per})
    g, with_prev, prev_sq = (
        torch.zeros(len(sites), len(sites), dtype=torch.float64),
        torch.zeros(len(sites), dtype=torch.float64),
        0.0,
    )

    def lazy(contribution: Contribution):  # noqa: ANN202 - in float64: the reference for figures formed in float64
        x = _factors_or_dense(contribution.slice.decode_lazy())
        return tuple(f.double() for f in x) if isinstance(x, tuple) else x.double()

    for key in set(contributions) | set(previous):
        before = [(c.weight, lazy(c)) for site, c in previous.get(key, {}).items() if site not in skip]
        prev_sq += sum(wa * wb * inner(a, b) for wa, a in before for wb, b in before)
        for i, a in enumerate(sites):
            if a not in contributions.get(key, {}):
                continue
            x = lazy(contributions[key][a])
            with_prev[i] += sum(w * inner(x, y) for w, y in before)
            for j, b in enumerate(sites):
                if b in contributions[key]:
                    g[i, j] += inner(x, lazy(contributions[key][b]))
    return sites, g, with_prev, prev_sq


@pytest.mark.parametrize("lowrank", [True, False])
def test_a_rounds_figures_equal_the_pairwise_ones_and_take_no_python_call_per_pair_of_sites(lowrank, monkeypatch):
    """The shard's CPU per site must not grow with the sites: with every update of a slice in one form (all
    low-rank, or all dense), `inner` — one Python call per pair — is never reached, and over dense slices no
    Gram is formed at all (sites × elements instead of sites² × elements; counts, not clocks). What the check
    uses of G — its diagonal, G w and wᵀ G w — and the products with the previous update equal the pairwise
    figures (sites of different weights, one site missing a slice, one left out of U as flagged)."""
    from dataclasses import replace

    from dilocox.server.checks import round_figures as figures_module

    sites = Round(n=24, lowrank=lowrank)
    first, _ = sites.contributions()
    first = {
        k: {c: replace(x, weight=10.0 * (i + 1)) for i, (c, x) in enumerate(sorted(per.items()))}
        for k, per in first.items()
    }
    second, _ = sites.contributions()
    del second[KEYS[1]]["site5"]
    skip = frozenset({"site1"})
    names, g, want_prev, want_prev_sq = _pairwise(second, first, skip)
    calls, grams = [], []
    monkeypatch.setattr(figures_module, "inner", lambda a, b: calls.append(1) or 0.0)
    real_gram = figures_module.gram
    monkeypatch.setattr(figures_module, "gram", lambda *a, **k: grams.append(1) or real_gram(*a, **k))
    figures = round_figures(second, first, skip)
    w = torch.rand(24, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w[3] = 0.0
    gw, wgw = figures.weighted(w)
    assert calls == [] and (grams != []) == lowrank and figures.clusters == names
    tolerance = dict(rtol=1e-4, atol=1e-6) if lowrank else dict(rtol=1e-9, atol=1e-9)
    assert torch.allclose(figures.sq_norms, g.diagonal(), **tolerance)
    assert torch.allclose(gw, g @ w, **tolerance) and wgw == pytest.approx(
        float(w @ g @ w), rel=1e-4 if lowrank else 1e-9
    )
    assert torch.allclose(figures.with_previous, want_prev, **tolerance)
    assert figures.previous_sq == pytest.approx(want_prev_sq, rel=1e-4 if lowrank else 1e-9) and figures.previous_sq > 0


@pytest.mark.parametrize("lowrank", [True, False])
def test_honest_rounds_raise_no_flag_and_each_fault_kind_is_caught(lowrank):
    sites = Round(lowrank=lowrank)
    check = UpdateCheck(UpdateCheckConfig(mode="exclude"))
    kept: dict = {}
    for _ in range(3):
        contributions, weights = sites.contributions()
        verdicts = review(check, contributions, weights)
        assert not any(v.reasons or v.excluded for v in verdicts.values()), verdicts
        kept = {c: {k: contributions[k][c].slice for k in KEYS} for c in weights}
        assert all(v.cosine_others is not None and v.cosine_others > 0.5 for v in verdicts.values())
    for fault, reason in (("scale", "outsized"), ("sign", "disagrees"), ("replay", "replayed")):
        contributions, weights = sites.contributions({2: fault}, replay=kept)
        verdicts = review(check, contributions, weights)
        # A size or a replay is left out at once; a direction alone once repeated (quarantine): one round's
        # cosine is noisy late in training.
        assert reason in verdicts["site2"].reasons and verdicts["site2"].excluded == (fault != "sign"), (
            fault,
            verdicts["site2"],
        )
        assert not any(verdicts[c].reasons for c in ("site0", "site1", "site3")), (fault, verdicts)
        if fault == "sign":
            again = review(check, *sites.contributions({2: fault}))["site2"]
            assert again.quarantined and again.excluded, again
            for _ in range(2):  # passes 2 in a row: released
                review(check, *sites.contributions())
        review(check, *sites.contributions())  # a clean round between faults: no streak carries over
    # Noise of an honest update's size points nowhere: its cosine with the others is about 0 — off its peers,
    # not against them (below −0.5 × their median cosine, where a sign flip sits), so its direction is not
    # flagged (docs/decisions.md says why: honest sites late in training look the same); the clipped mean
    # bounds what it can do.
    noisy = [review(check, *sites.contributions({2: "noise"}))["site2"] for _ in range(8)]
    assert all(abs(v.cosine_others) < 0.2 and "disagrees" not in v.reasons for v in noisy), noisy


def test_clip_scales_an_update_flagged_only_for_its_size_to_the_reference_norm_and_leaves_other_flags_out():
    sites = Round()
    check = UpdateCheck(UpdateCheckConfig(mode="clip"))
    for _ in range(3):
        honest = review(check, *sites.contributions())
    reference = sorted(v.norm for v in honest.values())  # the accepted norms the next round is measured against
    scaled = review(check, *sites.contributions({2: "scale"}))
    v = scaled["site2"]
    assert v.reasons == ("outsized",) and not v.excluded and 0 < v.scale < 0.05, v
    assert v.norm * v.scale == pytest.approx(v.norm / v.norm_ratio)  # clipped to the reference norm exactly
    assert reference[0] <= v.norm * v.scale <= reference[-1] * 1.5
    assert all(scaled[c].scale == 1.0 and not scaled[c].reasons for c in ("site0", "site1", "site3"))
    assert v.record()["scale"] == v.scale and "scale" not in scaled["site0"].record()  # the rounds chain says so
    flipped = review(check, *sites.contributions({2: "sign"}))["site2"]
    assert flipped.reasons == ("disagrees",) and flipped.excluded and flipped.scale == 1.0  # not a size: left out
    # Flagged rounds in a row quarantine it: then it is left out, whatever its flag (a clip bounds a spike).
    again = review(check, *sites.contributions({2: "scale"}))["site2"]
    assert again.quarantined and again.excluded and again.scale == 1.0


def test_the_round_applies_a_clip_factor_to_the_sum_and_not_to_the_total():
    """Σ c·w·Δ / Σ w: a clipped update counts at its full weight in the divisor (the honest sites' mean is not
    inflated), the same bits whether the contributions are taken together or one at a time."""
    from dilocox.common.wire.aggregation import apply_round, weighted_mean
    from dilocox.common.wire.outer_optimizer import OuterNesterov

    g = torch.Generator().manual_seed(0)
    deltas = {c: torch.randn(64, 8, generator=g) for c in ("a", "b", "c")}
    items = [(c, w, (lambda d=d: d)) for (c, d), w in zip(sorted(deltas.items()), (10.0, 20.0, 30.0))]
    mean = weighted_mean(items, {"c": 0.25})
    want = (deltas["a"] * 10.0 + deltas["b"] * 20.0 + deltas["c"] * (30.0 * 0.25)) / 60.0
    assert torch.allclose(mean, want, atol=1e-6)
    assert torch.equal(weighted_mean(items, {}), weighted_mean(items)) and torch.equal(
        weighted_mean(items, {"c": 1.0}), weighted_mean(items)
    )
    param = torch.randn(64, 8, generator=g)
    together = apply_round(items, OuterNesterov(0.7, 0.5), "k", param.clone(), decode_together=True, scales={"c": 0.25})
    alone = apply_round(items, OuterNesterov(0.7, 0.5), "k", param.clone(), decode_together=False, scales={"c": 0.25})
    assert torch.equal(together, alone)


def test_an_update_whose_figures_overflow_is_flagged_and_leaves_the_others_figures_whole():
    """Values finite enough to pass the shards' intake but whose squares overflow fp32 (an exponent bit
    flipped): that site is flagged `non_finite`, every other site's figures stay finite and unflagged, and
    what the rounds chain records of it is valid JSON."""
    import json

    sites = Round(lowrank=False)
    check = UpdateCheck(UpdateCheckConfig(mode="exclude"))
    review(check, *sites.contributions())
    contributions, weights = sites.contributions()
    key = KEYS[0]
    huge = contributions[key]["site1"].slice.decode()
    huge[0, :4] = 3e30
    contributions[key]["site1"] = Contribution("site1", 100.0, encoded(key, huge, None))
    verdicts = review(check, contributions, weights, previous=contributions)
    assert verdicts["site1"].reasons[0] == "non_finite" and verdicts["site1"].excluded
    for c in ("site0", "site2", "site3"):
        assert not verdicts[c].reasons and verdicts[c].cosine_others > 0.5, verdicts[c]
    json.dumps([v.record() for v in verdicts.values()], allow_nan=False)
    # Huge but finite and pointing nowhere (a flipped exponent in a low-rank factor): flagged outsized; the
    # honest sites are measured against each other, not against it.
    contributions, weights = sites.contributions({1: "noise"})
    for k in KEYS:
        contributions[k]["site1"] = Contribution(
            "site1", 100.0, encoded(k, 1e6 * contributions[k]["site1"].slice.decode(), None)
        )
    drowned = review(check, contributions, weights)
    assert "outsized" in drowned["site1"].reasons and not any(
        drowned[c].reasons for c in ("site0", "site2", "site3")
    ), drowned
    # The next round's reference leaves the flagged site out (it was merged in warn mode, say).
    nxt = review(check, sites.contributions()[0], weights, previous=contributions)  # site1's huge one, flagged
    assert not any(v.reasons for v in nxt.values()) and all(v.cosine_previous > 0.5 for v in nxt.values())


def test_a_site_flagged_rounds_in_a_row_is_quarantined_until_it_passes_as_many_or_is_readmitted():
    sites = Round()
    check = UpdateCheck(UpdateCheckConfig(mode="warn", quarantine_rounds=2))
    for _ in range(2):
        review(check, *sites.contributions())
    first = review(check, *sites.contributions({1: "sign"}))["site1"]
    assert first.reasons and not first.quarantined and not first.excluded  # warn: flagged, merged anyway
    second = review(check, *sites.contributions({1: "sign"}))["site1"]
    assert second.quarantined
    passed = review(check, *sites.contributions())["site1"]
    assert not passed.reasons and passed.quarantined  # one clean round is not enough
    flagged = review(check, *sites.contributions({1: "sign"}))["site1"]
    assert flagged.quarantined  # a flag on probation starts the count again
    assert [review(check, *sites.contributions())["site1"].quarantined for _ in range(2)] == [True, False]
    review(check, *sites.contributions({1: "sign"}))
    review(check, *sites.contributions({1: "sign"}))
    assert "site1" in check.quarantined and check.readmit("site1") and "site1" not in check.quarantined
    assert not review(check, *sites.contributions())["site1"].quarantined and not check.readmit("site1")


def test_exclude_leaves_a_quarantined_site_out_while_it_passes_and_a_restart_keeps_the_quarantine():
    """The point of quarantine: a faulty site that passes now and then (noise of an honest size) has its
    passing rounds left out too, until it passes quarantine_rounds in a row; the check's memory is part of
    the shard's checkpoint state, so a restarted shard does not release it."""
    sites = Round()
    check = UpdateCheck(UpdateCheckConfig(mode="exclude", quarantine_rounds=2))
    for _ in range(2):
        review(check, *sites.contributions())
    for _ in range(2):
        review(check, *sites.contributions({1: "sign"}))
    restarted = UpdateCheck(check.config)
    restarted.load_state(check.as_state())
    assert restarted.as_state() == check.as_state() and restarted.quarantined == {"site1"}
    probation = review(restarted, *sites.contributions())["site1"]
    assert not probation.reasons and probation.quarantined and probation.excluded
    released = review(restarted, *sites.contributions())["site1"]
    assert not released.quarantined and not released.excluded


def test_with_two_sites_the_pair_is_compared_and_the_previous_update_only_breaks_a_tie():
    sites = Round(n=2)
    check = UpdateCheck(UpdateCheckConfig(mode="exclude"))
    previous, weights = sites.contributions()
    first = review(check, previous, weights)
    assert all(v.norm_ratio is None and v.cosine_previous is None and v.cosine_others > 0.5 for v in first.values())
    current, _ = sites.contributions()
    second = review(check, current, weights, previous)
    assert not any(v.reasons for v in second.values()) and all(v.cosine_previous > 0.5 for v in second.values())
    scaled = review(check, sites.contributions({0: "scale"})[0], weights, current)
    assert "outsized" in scaled["site0"].reasons and not scaled["site1"].reasons
    flipped = review(check, sites.contributions({1: "sign"})[0], weights, current)
    assert (
        flipped["site1"].reasons == ("disagrees", "against_previous") and not flipped["site1"].excluded
    )  # until repeated
    assert not flipped["site0"].reasons
    # Both sites turn together (a learning-rate or data-mix change): they agree with each other, so the
    # previous update, which both now point away from, flags neither.
    sites.base = {k: -sites.base[k] for k in KEYS}
    turned = review(check, sites.contributions()[0], weights, current)
    assert all(v.cosine_previous < 0 and v.cosine_others > 0.5 and not v.reasons for v in turned.values()), turned


@pytest.mark.parametrize("mode", ["exclude", "clip"])
def test_honest_sites_whose_rounds_point_in_unrelated_directions_are_all_merged_every_round(mode):
    """Four honest sites, each round's direction drawn afresh (unrelated to the last): the old
    check flagged them against the previous update and once excluded all four. Judged against their peers,
    none is flagged, excluded or quarantined in 30 rounds."""
    sites = Round(seed=3)
    check = UpdateCheck(UpdateCheckConfig(mode=mode))
    previous: dict = {}
    lowest_previous = 1.0
    for _ in range(30):
        sites.base = {k: sites._direction(k) for k in KEYS}
        contributions, weights = sites.contributions()
        verdicts = review(check, contributions, weights, previous)
        assert not any(v.reasons or v.excluded or v.quarantined or v.scale != 1.0 for v in verdicts.values()), verdicts
        lowest_previous = min(
            [lowest_previous, *(v.cosine_previous for v in verdicts.values() if v.cosine_previous is not None)]
        )
        previous = contributions
    assert lowest_previous < 0  # the previous update was no guide: what the old check flagged on


def test_a_check_that_would_flag_most_of_a_round_acts_on_none_and_says_so():
    """Every site's update 30× larger (a learning-rate change): all four outsized. More than half flagged is
    the check being wrong about the round: nobody is left out or clipped, no streak grows (no quarantine),
    each verdict says overruled; the new norms join the history, so the flags stop by themselves."""
    sites = Round()
    check = UpdateCheck(UpdateCheckConfig(mode="exclude"))
    for _ in range(3):
        review(check, *sites.contributions())
    rounds = [review(check, *sites.contributions(dict.fromkeys(range(4), "scale"))) for _ in range(8)]
    assert all(v.overruled and not v.excluded and not v.quarantined for v in rounds[0].values())
    assert set(rounds[0]["site0"].reasons) == {"outsized"} and rounds[0]["site0"].record()["overruled"] is True
    assert all(not v.excluded and not v.quarantined for r in rounds for v in r.values())
    assert not any(v.reasons for v in rounds[-1].values()), rounds[-1]  # the history has caught up
    assert not check.streak or not any(check.streak.values())
    # One faulty site of four is still acted on (a quarter flagged: at most half).
    flipped = review(check, *sites.contributions({0: "scale", 1: "scale", 2: "scale", 3: "sign"}))
    assert not flipped["site3"].overruled and "disagrees" in flipped["site3"].reasons  # acted on: a quarter flagged
    again = review(check, *sites.contributions({3: "sign"}))["site3"]
    assert again.excluded and again.quarantined and not again.overruled


def test_a_site_cannot_move_its_own_reference_norm():
    """Two sites; one's update grows 1.3× a round. Its reference is the *other* site's accepted norms, so it
    is flagged outsized within a dozen rounds (1.3⁹ > 10); with the reference over both, its own growth
    dragged the median along."""
    sites = Round(n=2)
    check = UpdateCheck(UpdateCheckConfig(mode="exclude"))
    flagged_at = None
    for round_ in range(14):
        verdicts = review(check, *sites.contributions({0: 1.3**round_}))
        assert not verdicts["site1"].reasons, (round_, verdicts)
        if "outsized" in verdicts["site0"].reasons and flagged_at is None:
            flagged_at = round_
    assert flagged_at is not None and flagged_at <= 10, flagged_at


def test_the_end_of_run_flush_is_not_judged_by_training_rules():
    sites = Round()
    check = UpdateCheck(UpdateCheckConfig(mode="exclude"))
    for _ in range(3):
        review(check, *sites.contributions())
    contributions, weights = sites.contributions({1: "sign"})
    flush = {v.cluster: v for v in check.review(round_figures(contributions, None, check.last_flagged), judged=False)}
    assert not any(v.reasons or v.excluded for v in flush.values()) and flush["site1"].cosine_others < 0
    assert not any(check.streak.values())


def test_settings_are_checked():
    for bad in (
        {"mode": "clamp"},
        {"norm_ratio": 1.0},
        {"min_cosine": 1.5},
        {"quarantine_rounds": 0},
        {"max_flagged": 0},
        {"max_flagged": 1.5},
    ):
        with pytest.raises(ValueError):
            UpdateCheckConfig(**bad)


def test_real_shards_leave_a_faulty_site_out_and_every_replica_stays_bit_exact(shard_set):
    """Four clusters against two real shards in exclude mode; from round 3 one pushes its update × 100. It is
    flagged and left out by both shards, quarantined the round after, shown in Status; every cluster's
    replica (the faulty one's too) still equals the shards' weights and momentum bit for bit."""
    from tests import four_sites
    from tests.test_downlink import assert_replica_equals_shards, client

    shards = shard_set(2, "run-downlink", min_clusters=4, update_check=UpdateCheckConfig(mode="exclude"))
    clients = [client(shards.addresses, f"site{i}") for i in range(4)]
    try:
        four_sites.start(clients)
        for round_ in range(1, 6):
            four_sites.play(clients, round_, faulty=round_ >= 3, lasting=False)
            for shard in shards.shards:
                assert shard.last_round.excluded == (("site3",) if round_ >= 3 else ()), (round_, shard.last_round)
        for c in clients:
            assert_replica_equals_shards(c, shards)
        for shard in shards.shards:
            site = next(s for s in shard.status()["sites"] if s["cluster"] == "site3")
            assert site["rounds_flagged"] == 3 and site["rounds_excluded"] == 3 and site["quarantined"]
            assert site["last_flag"] == "outsized" and site["last_flag_round"] == 5
            assert all(s["rounds_flagged"] == 0 for s in shard.status()["sites"] if s["cluster"] != "site3")
        import grpc

        from dilocox.proto import dilocox_pb2 as pb
        from dilocox.proto import dilocox_pb2_grpc as pb_grpc

        with grpc.insecure_channel(shards.addresses[0]) as channel:  # what `dilocox status` reads
            reply = pb_grpc.AggregatorStub(channel).Status(pb.StatusRequest(), timeout=10)
        site = next(s for s in reply.sites if s.cluster == "site3")
        assert (site.rounds_flagged, site.rounds_excluded, site.quarantined, site.last_flag) == (3, 3, True, "outsized")
        from dilocox.worker.status import site_rows

        rows = {row[0]: row[-1] for row in site_rows([{"sites": shard.status()["sites"]} for shard in shards.shards])}
        assert rows == {
            "site0": "ok",
            "site1": "ok",
            "site2": "ok",
            "site3": "quarantined:3x:outsized@5",
        }  # `dilocox status`
    finally:
        for c in clients:
            c.close()


def test_real_shards_clip_an_outsized_site_and_every_replica_stays_bit_exact(shard_set, tmp_path):
    """Four clusters against two real shards in clip mode; from round 3 one pushes its update × 100. Both
    shards merge it clipped to the reference norm (nothing left out), the clip factor travels with the
    forwarded contribution, and every cluster's replica (the clipped one's too) equals the shards' weights
    and momentum bit for bit; the round's global step stays the size of an honest round's."""
    from tests import four_sites
    from tests.test_downlink import assert_replica_equals_shards, client

    shards = shard_set(2, "run-downlink", min_clusters=4, update_check=UpdateCheckConfig(mode="clip"))
    clients = [client(shards.addresses, f"site{i}") for i in range(4)]
    steps = []
    try:
        four_sites.start(clients)
        for round_ in range(1, 6):
            before = [{k: t.clone() for k, t in shard.snapshot.tensors.items()} for shard in shards.shards]
            four_sites.play(clients, round_, faulty=round_ >= 3)
            for shard in shards.shards:  # clipped in round 3; flagged again in 4: quarantined, left out
                assert shard.last_round.excluded == (("site3",) if round_ >= 4 else ()), (round_, shard.last_round)
            steps.append(
                sum(
                    float((shard.snapshot.tensors[k] - b[k]).norm() ** 2)
                    for shard, b in zip(shards.shards, before)
                    for k in b
                )
                ** 0.5
            )
            if round_ == 3:  # a shard restored from its checkpoint forwards the kept round with the same factors
                _assert_restored_alike(shards.shards[0], tmp_path)
        for c in clients:
            assert_replica_equals_shards(c, shards)
            assert c.replay_check.mismatches == 0  # replayed with the forwarded factor, not resynced by a full pull
        for shard in shards.shards:
            site = next(s for s in shard.status()["sites"] if s["cluster"] == "site3")
            assert site["rounds_clipped"] == 1 and site["rounds_excluded"] == 2 and site["last_flag"] == "outsized"
        # Round 3's step (the first with the × 100 site) against round 2's: clipped, the same order; merged
        # as pushed it would be about (3 + 100) / 4 ≈ 26 times as large.
        assert steps[2] < 3 * steps[1], steps
    finally:
        for c in clients:
            c.close()


def _assert_restored_alike(original, tmp_path) -> None:  # noqa: ANN001 - a server.shard.Shard
    from dilocox.server.shard import Shard
    from dilocox.server.state import checkpoint

    restored = Shard(
        original.shard_index, original.num_shards, original.run_id, update_check=original.update_check.config
    )
    checkpoint.restore(restored, checkpoint.load(checkpoint.save(original, tmp_path)))
    factors = lambda shard: {(k, c): x.scale for k, per in shard.snapshot.contributions.items() for c, x in per.items()}  # noqa: E731
    assert factors(restored) == factors(original) and any(f < 1 for f in factors(original).values())
    assert restored.update_check.as_state() == original.update_check.as_state()  # its streaks and history too


@pytest.mark.parametrize("mode", ["exclude", "clip"])
def test_real_shards_merge_four_honest_sites_whose_rounds_are_unrelated_as_a_plain_run_does(shard_set, mode):
    """Four honest sites, each round's direction new (the previous update no guide),
    under exclude and clip against two real shards: every site merged in every round, nobody flagged or
    quarantined, and the shards' weights and momentum bit for bit those of the same rounds with the check off;
    every replica equals its shards'."""
    from tests import four_sites
    from tests.test_downlink import assert_replica_equals_shards, client

    runs = {}
    for check in (mode, "off"):
        shards = shard_set(2, "run-downlink", min_clusters=4, update_check=UpdateCheckConfig(mode=check))
        clients = [client(shards.addresses, f"site{i}") for i in range(4)]
        try:
            four_sites.start(clients)
            for round_ in range(1, 9):
                four_sites.play(clients, round_, faulty=False, lasting=False)
                for shard in shards.shards:
                    assert (
                        shard.last_round.clusters == ("site0", "site1", "site2", "site3")
                        and not shard.last_round.excluded
                    ), (round_, shard.last_round)
            for c in clients:
                assert_replica_equals_shards(c, shards)
            if check != "off":
                for shard in shards.shards:
                    assert all(s["rounds_flagged"] == 0 and not s["quarantined"] for s in shard.status()["sites"]), (
                        shard.status()["sites"]
                    )
                    assert shard.rounds_overruled == 0
            runs[check] = [
                (
                    {k: t.clone() for k, t in s.snapshot.tensors.items()},
                    {k: t.clone() for k, t in s.optimizer.buffers.items()},
                )
                for s in shards.shards
            ]
        finally:
            for c in clients:
                c.close()
    for (weights, momentum), (plain_weights, plain_momentum) in zip(runs[mode], runs["off"]):
        assert weights.keys() == plain_weights.keys() and all(
            torch.equal(weights[k], plain_weights[k]) for k in weights
        )
        assert all(torch.equal(momentum[k], plain_momentum[k]) for k in momentum)


def test_real_shards_weigh_an_inflated_token_claim_at_a_multiple_of_the_others_and_leave_its_negation_out(shard_set):
    """Tokens are a claim. A site saying 1000× the others' tokens weighs 4× their median (the
    round record keeps both: said and used), its claim cannot make it "the others" for the honest sites
    (one vote a site), and once it pushes its update negated it alone is flagged, and left out when that repeats."""
    from dilocox.worker.exchange.cluster import slice_tensors
    from tests import four_sites
    from tests.test_downlink import PARAMS, assert_replica_equals_shards, client, low_rank_delta

    shards = shard_set(2, "run-downlink", min_clusters=4, update_check=UpdateCheckConfig(mode="exclude"))
    clients = [client(shards.addresses, f"site{i}") for i in range(4)]
    try:
        four_sites.start(clients)
        base = low_rank_delta(100)
        for round_ in range(1, 5):
            fresh = {n: base[n] + 0.5 * t for n, t in low_rank_delta(100 + round_).items()}
            for i, c in enumerate(clients):
                own = low_rank_delta(10 * round_ + i)
                delta = {n: fresh[n] + 0.3 * own[n] for n, _ in PARAMS}
                liar = i == 3
                if liar and round_ >= 3:
                    delta = {n: -t for n, t in delta.items()}
                c.push(round_, 100_000.0 if liar else 100.0, slice_tensors(c.assignment, delta))
            for c in clients:
                assert c.pull(round_, wait_seconds=10)[0] == round_
            for shard in shards.shards:
                record = shard.chain.entries[-1]
                used = {s["cluster"]: (s["tokens"], s["weight"]) for s in record["sites"]}
                if round_ < 3:  # honest direction, inflated claim: merged at 4 × the others' median
                    assert not shard.last_round.excluded and used["site3"] == (100_000.0, 400.0), (round_, used)
                else:
                    # flagged for its direction in round 3, left out once that repeats (quarantine, round 4)
                    assert shard.last_round.excluded == (("site3",) if round_ >= 4 else ()), (round_, shard.last_round)
                flagged = {s["cluster"] for s in shard.status()["sites"] if s["rounds_flagged"]}
                assert flagged == (set() if round_ < 3 else {"site3"}), (round_, flagged)
        for c in clients:
            assert_replica_equals_shards(c, shards)
    finally:
        for c in clients:
            c.close()


def test_clip_factors_bound_each_site_by_the_other_sites_median_norm():
    from dilocox.server.checks.robust_mean import AggregateConfig, clip_factors

    assert clip_factors({"a": 1.0, "b": 1.2, "c": 0.9, "d": 1.5}, 2.0) == {}  # honest spread: nobody clipped
    assert clip_factors({"a": 1.0, "b": 1.2, "c": 0.9, "big": 9.5}, 2.0) == {"big": pytest.approx(2.0 / 9.5)}
    assert clip_factors({"a": 1.0, "big": 9.5}, 2.0) == {"big": pytest.approx(2.0 / 9.5)}  # two sites: the other's norm
    assert (
        clip_factors({"a": 1.0, "inf": float("inf")}, 2.0) == {"inf": 0.0} and clip_factors({"alone": 50.0}, 2.0) == {}
    )
    with pytest.raises(ValueError):
        AggregateConfig("median")
    with pytest.raises(ValueError):
        AggregateConfig("clipped-mean", 0.5)


def test_real_shards_clipped_mean_bounds_a_site_under_the_checks_bounds_and_replays_stay_exact(shard_set):
    """A site pushing its update ×6 every round (under the check's 10×: never flagged) makes a plain
    mean's step (3 + 6) / 4 = 2.25 honest ones; under --aggregate clipped-mean each shard scales it to 2× the
    others' median (1.25), forwards the factor (the round record says it), and every replica equals its
    shards' bit for bit."""
    from dilocox.server.checks.robust_mean import AggregateConfig
    from dilocox.worker.exchange.cluster import slice_tensors
    from tests import four_sites
    from tests.test_downlink import PARAMS, assert_replica_equals_shards, client, low_rank_delta

    steps = {}
    for rule in ("mean", "clipped-mean"):
        shards = shard_set(
            2,
            "run-downlink",
            min_clusters=4,
            update_check=UpdateCheckConfig(mode="exclude"),
            aggregate=AggregateConfig(rule),
        )
        clients = [client(shards.addresses, f"site{i}") for i in range(4)]
        try:
            four_sites.start(clients)
            base = low_rank_delta(100)
            norms = []
            for round_ in range(1, 5):
                before = [{k: t.clone() for k, t in shard.snapshot.tensors.items()} for shard in shards.shards]
                fresh = {n: base[n] + 0.5 * t for n, t in low_rank_delta(100 + round_).items()}
                for i, c in enumerate(clients):
                    own = low_rank_delta(10 * round_ + i)
                    delta = {n: (6.0 if i == 3 else 1.0) * (fresh[n] + 0.3 * own[n]) for n, _ in PARAMS}
                    c.push(round_, 100.0, slice_tensors(c.assignment, delta))
                for c in clients:
                    assert c.pull(round_, wait_seconds=10)[0] == round_
                norms.append(
                    sum(
                        float((s.snapshot.tensors[k] - b[k]).norm() ** 2)
                        for s, b in zip(shards.shards, before)
                        for k in b
                    )
                    ** 0.5
                )
                for shard in shards.shards:
                    assert not shard.last_round.excluded and not any(
                        s["rounds_flagged"] for s in shard.status()["sites"]
                    )
                    scales = {s["cluster"]: s.get("scale") for s in shard.chain.entries[-1]["sites"]}
                    if rule == "clipped-mean":
                        assert scales["site3"] is not None and 0.25 < scales["site3"] < 0.45, scales
                        assert all(scales[f"site{i}"] is None for i in range(3)), scales
                    else:
                        assert all(v is None for v in scales.values()), scales
            for c in clients:
                assert_replica_equals_shards(c, shards)
                assert c.replay_check.mismatches == 0
            steps[rule] = norms
        finally:
            for c in clients:
                c.close()
    assert all(clipped < 0.65 * plain for clipped, plain in zip(steps["clipped-mean"][1:], steps["mean"][1:])), steps


def test_a_byte_identical_copy_is_not_judged_but_counted_once():
    """A site pushing another's update byte for byte: neither is flagged (which is the copy cannot be told),
    each verdict says `copies` 2, and under clip or exclude the two weigh together what one would."""
    from dilocox.server.checks.site_verdict import copied_weights

    sites = Round()
    check = UpdateCheck(UpdateCheckConfig(mode="exclude"))
    review(check, *sites.contributions())
    contributions, weights = sites.contributions()
    for key in KEYS:
        contributions[key]["site3"] = dataclasses.replace(contributions[key]["site1"], cluster="site3")
    figures = round_figures(contributions, None, check.last_flagged)
    verdicts = {v.cluster: v for v in check.review(figures)}
    assert [verdicts[c].copies for c in ("site0", "site1", "site2", "site3")] == [1, 2, 1, 2]
    assert not any(v.reasons or v.excluded for v in verdicts.values()) and verdicts["site3"].record()["copies"] == 2
    counted = copied_weights(verdicts.values(), {**weights, "site3": 1000.0}, figures.contribution_digests)
    assert counted == {"site1": 50.0, "site3": 50.0}  # the group's smallest weight, shared


def test_real_shards_count_a_site_copying_anothers_update_once(shard_set):
    """Site3 pushes site1's update byte for byte every round (free-riding). Under exclude nobody is
    flagged or left out, the two weigh 50 + 50 tokens instead of 100 + 100 (the round record says so),
    replicas stay bit-exact, and the weights end as a run without the copier ends (to rounding)."""
    from dilocox.worker.exchange.cluster import slice_tensors
    from tests.test_downlink import PARAMS, assert_replica_equals_shards, client, low_rank_delta

    def run(copier: bool) -> list[dict]:
        sites = 4 if copier else 3
        shards = shard_set(2, "run-downlink", min_clusters=sites, update_check=UpdateCheckConfig(mode="exclude"))
        clients = [client(shards.addresses, f"site{i}") for i in range(sites)]
        try:
            for c in clients:
                c.join(PARAMS)
            clients[0].push(0, 1.0, slice_tensors(clients[0].assignment, {n: torch.zeros(s) for n, s in PARAMS}))
            for c in clients:
                assert c.pull(0, wait_seconds=10)[0] == 0
            base = low_rank_delta(100)
            for round_ in range(1, 5):
                fresh = {n: base[n] + 0.5 * t for n, t in low_rank_delta(100 + round_).items()}
                for i, c in enumerate(clients):
                    own = low_rank_delta(10 * round_ + (1 if i == 3 else i))  # site3: site1's update
                    c.push(round_, 100.0, slice_tensors(c.assignment, {n: fresh[n] + 0.3 * own[n] for n, _ in PARAMS}))
                for c in clients:
                    assert c.pull(round_, wait_seconds=10)[0] == round_
                for shard in shards.shards:
                    assert not shard.last_round.excluded and not any(
                        s["rounds_flagged"] for s in shard.status()["sites"]
                    )
                    if copier:
                        used = {s["cluster"]: s["weight"] for s in shard.chain.entries[-1]["sites"]}
                        assert used == {"site0": 100.0, "site1": 50.0, "site2": 100.0, "site3": 50.0}, used
            for c in clients:
                assert_replica_equals_shards(c, shards)
            return [{k: t.clone() for k, t in s.snapshot.tensors.items()} for s in shards.shards]
        finally:
            for c in clients:
                c.close()

    with_copier, without = run(True), run(False)
    for a, b in zip(with_copier, without):
        assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)
