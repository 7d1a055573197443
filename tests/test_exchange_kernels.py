"""The exchange's faster paths give the bits of the plain forms they replace.

* the low-rank decode by steps of rows (`OrderedProduct`), whole, by any row range, and subtracted in
  place, equals the plain ordered sum of rank-1 terms;
* the round's mean built from low-rank factors block by block (`apply_round` with `decode_lazy`) equals
  the mean of the dense decodes, and the outer step on it;
* error feedback formed in the residual's own buffer equals `(Δ + e) − D(C(Δ + e))`;
* the power iteration with the thin factor first is the same product;
* the exchange's thread budget is its own: the training thread's count does not move.
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from dilocox.common.wire import codecs, lowrank
from dilocox.common.wire.aggregation import apply_round, decode_by_blocks
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.common.wire.lowrank import (
    PRODUCT_STEP_ELEMENTS,
    OrderedProduct,
    encode_lowrank,
    lowrank_factors,
    power_iteration,
)
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.worker.exchange.threads import exchange_thread_budget, use_exchange_threads


def _plain(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    out = p[:, 0:1] * q[:, 0]
    for i in range(1, p.shape[1]):
        out = out + p[:, i : i + 1] * q[:, i]
    return out


FORMS = [
    "torch",
    pytest.param("compiled", marks=pytest.mark.skipif(lowrank._kernels is None, reason="no C compiler at install")),
]


def test_the_compiled_decode_is_built_where_a_c_compiler_is():
    if shutil.which("cc") or shutil.which("gcc"):
        assert lowrank._kernels is not None, "setup.py's extension was not built: the decode runs the slower torch form"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows,cols,rank", [(300, 517, 8), (2, 70_000, 3), (1000, 1, 1), (65, 2048, 5), (700, 1300, 7)])
def test_ordered_product_by_steps_is_the_plain_ordered_sum(rows, cols, rank, form):
    g = torch.Generator().manual_seed(rows * cols + rank)
    p, q = torch.randn(rows, rank, generator=g), torch.randn(cols, rank, generator=g)
    p[0, 0], q[0, 0] = 1e-30, 1e-10  # a subnormal product: no flush to zero in either form
    product = OrderedProduct(p.T.contiguous(), q.T.contiguous(), compiled=form == "compiled")
    assert product.compiled == (form == "compiled")
    plain = _plain(p, q)
    assert product.step_rows < rows or rows * cols <= PRODUCT_STEP_ELEMENTS  # several steps where the size allows
    assert torch.equal(product.dense(), plain)
    for start, stop in ((0, 1), (rows // 3, rows), (rows - 1, rows)):
        assert torch.equal(product.rows_into(start, stop, torch.empty(stop - start, cols)), plain[start:stop])
    target = torch.randn(rows, cols, generator=g)
    expected = target - plain
    product.subtract_from(target)
    assert torch.equal(target, expected)


@pytest.mark.skipif(lowrank._kernels is None, reason="no C compiler at install")
def test_the_compiled_decode_split_over_threads_has_the_same_bits():
    g = torch.Generator().manual_seed(5)
    p_t, q_t = torch.randn(8, 1500, generator=g), torch.randn(8, 900, generator=g)
    one = OrderedProduct(p_t, q_t).dense()
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert torch.equal(OrderedProduct(p_t, q_t).dense(), one)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(OrderedProduct(p_t, q_t, compiled=False).dense(), one)


def _lowrank_slice(key: SliceKey, shape: tuple[int, int], seed: int) -> EncodedSlice:
    g = torch.Generator().manual_seed(seed)
    rank = min(4, *shape)
    p, q = torch.randn(shape[0], rank, generator=g), torch.randn(shape[1], rank, generator=g)
    return EncodedSlice(key, "lowrank", "float32", shape, bytearray(encode_lowrank(p, q, 4)))


@pytest.mark.parametrize("shape", [(600, 700), (3, 100_000)])
def test_mean_of_lowrank_factors_by_blocks_is_the_mean_of_dense_decodes(shape):
    key = SliceKey("w", 0, shape[0])
    slices = [_lowrank_slice(key, shape, seed) for seed in (1, 2, 3)]
    dense = codecs.encode("fp32", torch.randn(shape))[0]
    slices.append(EncodedSlice(key, "fp32", "float32", shape, bytearray(dense)))  # a dense one beside them
    assert decode_by_blocks(s.codec for s in slices)
    param = torch.randn(shape)
    momentum = torch.randn(shape)

    def stepped(lazy: bool, together: bool) -> tuple[torch.Tensor, torch.Tensor]:
        outer = OuterNesterov(0.7, 0.9)
        outer.buffers[key] = momentum.clone()
        items = [(f"c{i}", 100.0 + 7 * i, s.decode_lazy if lazy else s.decode) for i, s in enumerate(slices)]
        new = apply_round(items, outer, key, param.clone(), decode_together=together)
        return new, outer.buffers[key]

    reference = stepped(lazy=False, together=False)  # the mean of whole decodes, one at a time
    for lazy, together in ((True, True), (True, False), (False, True)):
        new, buffer = stepped(lazy, together)
        assert torch.equal(new, reference[0]) and torch.equal(buffer, reference[1])


def test_error_feedback_in_the_residuals_buffer_has_the_bits_of_the_plain_form():
    config = CompressionConfig(rank_min=3, rank_max=3, adaptive_rank=False, min_lowrank_numel=16)
    compressor = TensorCompressor(config, seed=4)
    g = torch.Generator().manual_seed(9)
    for key, shape in (("matrix", (120, 90)), ("vector", (50,))):
        for _ in range(3):
            delta = torch.randn(shape, generator=g)
            before = compressor.residual(key)
            target = delta + before if before is not None else delta.clone()
            encoded = compressor.compress(key, delta)
            received = codecs.decode(encoded.codec, bytearray(encoded.payload), encoded.dtype, encoded.shape)
            assert torch.equal(compressor.residual(key), target - received)
    residual = compressor.residual("matrix").clone()
    flushed = compressor.compress("matrix", torch.zeros(120, 90), codec="fp32")  # the end-of-run flush
    assert torch.equal(codecs.decode("fp32", bytearray(flushed.payload), "float32", (120, 90)), residual)  # sent whole
    assert torch.count_nonzero(compressor.residual("matrix")) == 0  # and nothing is left behind


def test_a_refused_pseudo_gradient_leaves_the_residual_as_it_was():
    compressor = TensorCompressor(CompressionConfig(min_lowrank_numel=16), seed=1)
    compressor.compress("w", torch.randn(30, 20))
    before = compressor.residual("w").clone()
    bad = torch.randn(30, 20)
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        compressor.compress("w", bad)
    assert torch.equal(compressor.residual("w"), before)


def test_power_iteration_with_the_thin_factor_first_is_the_same_product():
    g = torch.Generator().manual_seed(3)
    matrix, q = torch.randn(700, 300, generator=g), torch.randn(300, 6, generator=g)
    p, q_next = power_iteration(matrix, q)
    expected_p, _ = torch.linalg.qr(matrix @ q, mode="reduced")
    torch.testing.assert_close(p.abs(), expected_p.abs(), rtol=1e-4, atol=1e-5)  # columns up to sign
    torch.testing.assert_close(q_next, matrix.T @ p, rtol=1e-4, atol=1e-4)


def test_lowrank_factors_of_own_payload_subtract_like_the_receivers_decode():
    payload = encode_lowrank(torch.randn(40, 5), torch.randn(33, 5), 4)
    target = torch.randn(40, 33)
    expected = target - codecs.decode("lowrank", bytearray(payload), "float32", (40, 33))
    OrderedProduct(*lowrank_factors(payload)).subtract_from(target)
    assert torch.equal(target, expected)


def test_the_exchange_threads_count_is_its_own():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    seen = {}

    def exchange() -> None:
        use_exchange_threads(2)
        seen["exchange"] = torch.get_num_threads()

    try:
        thread = threading.Thread(target=exchange)
        thread.start()
        thread.join()
        assert seen["exchange"] == 2 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)  # the process's count as it was, for the tests after this one


def test_exchange_thread_budget(monkeypatch):
    monkeypatch.setattr("dilocox.worker.exchange.threads.usable_cores", lambda: 16)
    assert exchange_thread_budget(3) == 3  # asked for
    assert exchange_thread_budget(0, training_threads=1, local_ranks=1) == 15
    assert exchange_thread_budget(0, training_threads=1, local_ranks=8) == 1  # 2 cores a rank, one trains
    assert exchange_thread_budget(0, training_threads=1, local_ranks=4) == 3
    assert exchange_thread_budget(0, training_threads=16, local_ranks=1) == 1  # never below 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert exchange_thread_budget(0, training_threads=1) == 7  # torchrun's ranks on this node
    with pytest.raises(ValueError):
        exchange_thread_budget(-1)


@pytest.mark.parametrize("momentum_state", ["none", "in_place", "new"])
def test_the_fused_round_update_has_the_bits_of_torchs_operations(monkeypatch, momentum_state):
    """The compiled mean + Nesterov step (where built) against the same operations in torch, one rounded
    operation each, with weights, lr and μ that are not exact in fp32."""
    from dilocox.common.wire import outer_optimizer

    g = torch.Generator().manual_seed(11)
    n = (1 << 18) + 1234  # more than one block, and a partial one
    sources = [torch.randn(n, generator=g) * 1e-3 for _ in range(3)]
    weights = [1000.3, 977.7, 1013.1]
    param, old = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3

    def update(compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not compiled:
            monkeypatch.setattr(outer_optimizer, "_kernels", None)
        outer = OuterNesterov(lr=0.7, momentum=0.9)
        if momentum_state != "none":
            outer.buffers["k"] = old.clone()
        items = [(f"c{i}", w, lambda s=s: s) for i, (s, w) in enumerate(zip(sources, weights))]
        new = apply_round(items, outer, "k", param.clone(), in_place=momentum_state == "in_place")
        monkeypatch.undo()
        return new, outer.buffers["k"]

    torch_form = update(compiled=False)
    # the formula, written out in torch: g = ((s₀w₀ + s₁w₁) + s₂w₂) / Σw; v = vμ + g; θ − ((vμ + g)·lr)
    mean = sources[0] * weights[0]
    for s, w in zip(sources[1:], weights[1:]):
        mean = mean + s * w
    total = 0.0
    for w in weights:
        total += w
    mean = mean / total
    v = mean if momentum_state == "none" else old * 0.9 + mean
    assert torch.equal(torch_form[1], v) and torch.equal(torch_form[0], param - (v * 0.9 + mean) * 0.7)
    if outer_optimizer._kernels is not None:
        compiled = update(compiled=True)
        assert torch.equal(compiled[0], torch_form[0]) and torch.equal(compiled[1], torch_form[1])


def test_a_round_of_more_contributions_than_the_kernel_takes_falls_back_to_torch(monkeypatch):
    from dilocox.common.wire import outer_optimizer

    monkeypatch.setattr(outer_optimizer, "FUSED_MAX_SOURCES", 2)  # as if 3 were over the kernel's bound
    g = torch.Generator().manual_seed(2)
    sources = [torch.randn(1000, generator=g) for _ in range(3)]
    items = [(f"c{i}", 10.0 + i, lambda s=s: s) for i, s in enumerate(sources)]
    over = apply_round(items, OuterNesterov(0.7, 0.9), "k", torch.zeros(1000))
    monkeypatch.setattr(outer_optimizer, "FUSED_MAX_SOURCES", 256)
    assert torch.equal(over, apply_round(items, OuterNesterov(0.7, 0.9), "k", torch.zeros(1000)))
