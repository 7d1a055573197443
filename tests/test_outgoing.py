"""The round boundary folds θ into the outgoing buffer and the next start as it arrives.

Held against the arithmetic the boundary did before over whole buffers (θ into a work buffer, Δ = s − θ,
the start from the replica minus the residual, the compressor's e += Δ): bit for bit, for every delayed
start rule, from the replica or from s_t, with error feedback kept in the weights, classic with a decay,
and none; θ handed over in uneven row pieces and cut into chunks. And on gloo: a site's gather lands
every owned row once, with the values the whole-buffer gather gives.
"""

from __future__ import annotations

import math

import pytest
import torch

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.worker.exchange import outgoing as outgoing_module
from dilocox.worker.exchange.delayed_start import next_start
from dilocox.worker.exchange.host_buffers import HostBuffers
from dilocox.worker.exchange.outgoing import NextStart, OutgoingFold
from dilocox.worker.site.mesh import SiteShape
from dilocox.worker.site.reshard import Resharder, StageResharder
from tests.gloo_ranks import on_gloo_ranks

SHAPES = {"w": (9, 6), "b": (7,), "s": (), "u": (40, 130)}  # "u": low rank; cut into two slices


def _slices() -> list[ParamSlice]:
    out = []
    for name, shape in SHAPES.items():
        rows = shape[0] if shape else 1
        cuts = [0, 4, rows] if name in ("w", "u") else [0, rows]
        out += [ParamSlice(name, shape, a, b, shard=i % 2) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return out


def _restored(config: CompressionConfig, residuals: dict) -> TensorCompressor:
    """A compressor holding `residuals` as a checkpoint restores them."""
    compressor = TensorCompressor(config)
    compressor.load_state_dict(
        {key: {"error": e.clone(), "q": None, "rank": 0, "recent_ranks": []} for key, e in residuals.items()}
    )
    return compressor


def _random(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g)


MODES = {
    "local": CompressionConfig(),
    "classic": CompressionConfig(local_residual=False, error_decay=0.9, flush_codec="none"),
    "no-feedback": CompressionConfig(error_feedback=False, flush_codec="none"),
    "uncompressed": None,
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "start",
    [None, ("own", True), ("own", False), ("estimate", True), ("estimate", False), ("eager", True), ("eager", False)],
)
def test_fold_is_the_whole_buffer_arithmetic_bit_for_bit(mode, start, monkeypatch):
    monkeypatch.setattr(outgoing_module, "CHUNK_ELEMENTS", 7)  # chunks that cut rows and slices
    g = torch.Generator().manual_seed(1)
    slices = _slices()
    s_t = {n: _random(shape, g) for n, shape in SHAPES.items()}
    theta = {n: s_t[n] - 0.01 * _random(shape, g) for n, shape in SHAPES.items()}
    held = {sl.key: sl.view(s_t[sl.name]) + 0.001 * _random(sl.slice_shape, g) for sl in slices}
    outer = OuterNesterov(0.7, 0.9)
    outer.buffers = {sl.key: _random(sl.slice_shape, g) for sl in slices[::2]}  # some slices have none yet
    config = MODES[mode]
    residuals = {sl.key: 0.01 * _random(sl.slice_shape, g) for sl in slices[1:]}  # the first has none yet

    # Before: whole buffers, the compressor adding Δ into its residual.
    reference = _restored(config, residuals if config.error_feedback else {}) if config else None
    expected_start = {n: t.clone() for n, t in s_t.items()}
    delta = {n: s_t[n] - theta[n] for n in SHAPES}
    expected_out = {}
    for sl in slices:
        d = sl.view(delta[sl.name])
        if start is not None:
            rule, from_held = start
            base = sl.view(expected_start[sl.name])
            if from_held:
                base.copy_(held[sl.key])
                residual = (
                    reference.residual(sl.key) if reference is not None and reference.keeps_local_residual else None
                )
                if residual is not None:
                    base.sub_(residual)
            momentum = outer.buffers.get(sl.key)
            next_start(rule, base, base, d, momentum, outer, 0.5, torch.zeros_like(d) if rule == "eager" else None)
        e = reference.residual(sl.key) if reference is not None and config.error_feedback else None
        if e is None:
            expected_out[sl.key] = d.clone()
        elif config.error_decay == 1:
            expected_out[sl.key] = e.clone().add_(d)
        else:
            expected_out[sl.key] = d + config.error_decay * e

    # Now: θ folded in as uneven row pieces arrive.
    compressor = _restored(config, residuals if config.error_feedback else {}) if config else None
    buffers = HostBuffers(SHAPES)
    for n in SHAPES:
        buffers.start[n].copy_(s_t[n])
    fold = OutgoingFold(buffers, slices, compressor)
    rule = None if start is None else NextStart(start[0], start[1], 0.5)
    folding = fold.fold(held, rule, outer)
    for name, shape in SHAPES.items():
        rows, flat = (shape[0] if shape else 1), theta[name].reshape(-1)
        width = math.prod(shape[1:]) if len(shape) > 1 else 1
        for a, b in [(0, 1), (1, 5), (5, rows)] if rows > 5 else [(0, rows)]:
            folding(name, a, b, flat[a * width : b * width].clone())
    assert folding.nonfinite is None
    for n in SHAPES:
        assert torch.equal(buffers.start[n], expected_start[n] if start is not None else s_t[n]), n
    for key, out in fold.outgoing_slices().items():
        assert torch.equal(out, expected_out[key]), key
    if compressor is not None and config.error_feedback:  # the residual is the outgoing buffer itself
        assert all(buffers.holds(compressor.residual(sl.key)) for sl in slices)


@pytest.mark.parametrize("mode", ["local", "uncompressed"])
def test_a_mid_round_merge_rebases_the_live_model_on_theta_bit_for_bit(mode, monkeypatch):
    """`overlap_steps`: the rebase writes x − s + (θ − e) for the model, piece by piece and in chunks, as the
    whole-buffer arithmetic gives it; the start then becomes θ − e."""
    monkeypatch.setattr(outgoing_module, "CHUNK_ELEMENTS", 7)
    g = torch.Generator().manual_seed(3)
    slices = _slices()
    s_t = {n: _random(shape, g) for n, shape in SHAPES.items()}
    live = {n: s_t[n] - 0.01 * _random(shape, g) for n, shape in SHAPES.items()}
    held = {sl.key: sl.view(s_t[sl.name]) + 0.001 * _random(sl.slice_shape, g) for sl in slices}
    config = MODES[mode]
    compressor = _restored(config, {sl.key: 0.01 * _random(sl.slice_shape, g) for sl in slices}) if config else None
    expected = {n: live[n].clone() for n in SHAPES}
    for sl in slices:
        target = sl.view(expected[sl.name])
        target.sub_(sl.view(s_t[sl.name])).add_(held[sl.key])
        if compressor is not None:
            target.sub_(compressor.residual(sl.key))
    buffers = HostBuffers(SHAPES)
    fold = OutgoingFold(buffers, slices, compressor)
    for n in SHAPES:
        buffers.start[n].copy_(s_t[n])
    rebase = fold.rebase(held)
    for name, shape in SHAPES.items():
        rows, flat = (shape[0] if shape else 1), live[name].reshape(-1)
        width = math.prod(shape[1:]) if len(shape) > 1 else 1
        for a, b in [(0, 1), (1, 5), (5, rows)] if rows > 5 else [(0, rows)]:
            rebase(name, a, b, flat[a * width : b * width].clone())
    for n in SHAPES:
        assert torch.equal(buffers.start[n], expected[n]), n


def test_compressing_the_formed_buffer_sends_and_keeps_what_compressing_delta_did():
    g = torch.Generator().manual_seed(2)
    sl = ParamSlice("u", (40, 130), 0, 40, 0)
    e, d = 0.01 * _random((40, 130), g), _random((40, 130), g)
    before = _restored(CompressionConfig(), {sl.key: e})
    sent_before = before.compress(sl.key, d)
    buffers = HostBuffers({"u": (40, 130)})
    now = _restored(CompressionConfig(), {sl.key: e})
    fold = OutgoingFold(buffers, [sl], now)
    buffers.start["u"].copy_(d)  # s − θ = d with θ = 0
    fold.fold({}, None, None)("u", 0, 40, torch.zeros(40 * 130))
    sent_now = now.compress_formed(sl.key, fold.outgoing_slices()[sl.key])
    assert bytes(sent_now.payload) == bytes(sent_before.payload) and sent_now.rank == sent_before.rank
    assert torch.equal(now.residual(sl.key), before.residual(sl.key)) and buffers.holds(now.residual(sl.key))
    with pytest.raises(ValueError, match="hold_residual"):
        now.compress_formed(sl.key, fold.outgoing_slices()[sl.key].clone())


def test_a_nonfinite_delta_leaves_the_residual_and_the_start_as_they_were():
    sl = ParamSlice("b", (7,), 0, 7, 0)
    buffers = HostBuffers({"b": (7,)})
    compressor = _restored(CompressionConfig(), {sl.key: torch.full((7,), 0.5)})
    fold = OutgoingFold(buffers, [sl], compressor)
    buffers.start["b"].fill_(1.0)
    folding = fold.fold({sl.key: torch.zeros(7)}, NextStart("own", True, 1.0), None)
    folding("b", 0, 7, torch.tensor([0.0, 1, 2, float("nan"), 4, 5, 6]))
    assert folding.nonfinite == sl.key
    assert torch.equal(compressor.residual(sl.key), torch.full((7,), 0.5)) and torch.equal(
        buffers.start["b"], torch.ones(7)
    )


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float32) + 1000 * (sum(map(ord, name)) % 7)).reshape(shape)


def _gather_rows_rank(rank: int, world: int, replicate: int) -> tuple:
    shapes = {"big": (50, 8), "mid": (13, 5), "bias": (9,), "scalar": ()}
    shape = SiteShape(1, world, replicate)
    plan = StageResharder(shapes, shape, rank, sharded=True, batch_elements=120)
    resharder = Resharder(plan, None, torch.device("cpu"))
    local = {}
    for name, full in ((n, _full(n, s)) for n, s in shapes.items()):
        a, b = plan.rows_of(name, rank)
        local[name] = full.reshape(-1, *full.shape[1:])[a:b] if full.dim() else full
    whole = {n: torch.zeros(shapes[n]) for n in plan.owned}
    resharder.gather(local, whole)
    landed = {n: torch.zeros(shapes[n]).reshape(-1) for n in plan.owned}
    counts = {n: torch.zeros(shapes[n][0] if shapes[n] else 1) for n in plan.owned}

    def land(name: str, first: int, last: int, rows: torch.Tensor) -> None:
        width = plan.row_numel[name]
        landed[name][first * width : last * width] += rows
        counts[name][first:last] += 1

    resharder.gather_rows(local, land)
    ok = all(
        torch.equal(landed[n].reshape(shapes[n]), whole[n]) and torch.equal(whole[n], _full(n, shapes[n]))
        for n in plan.owned
    )
    once = all(bool((c == 1).all()) for c in counts.values())
    largest = resharder._host.numel()
    return rank, ok, once, largest, sorted(plan.owned)


@pytest.mark.parametrize("replicate", [1, 2])
@pytest.mark.usefixtures("rank_forkserver")
def test_a_sites_gather_lands_every_owned_row_once_through_one_batch_buffer(replicate):
    results = on_gloo_ranks(_gather_rows_rank, 4, 4, replicate)
    assert all(ok and once for _, ok, once, _, _ in results), results
    assert sorted(n for *_, owned in results for n in owned) == ["bias", "big", "mid", "scalar"]
    assert all(largest <= 120 for _, _, _, largest, _ in results)  # the landing buffer: one batch at most
