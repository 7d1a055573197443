"""The loss over bf16 logits taken a piece at a time: the plain loss's gradient bit for bit, without the
microbatch's logits ever existing in fp32 (peak memory measured with torch's own MemTracker)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from dilocox.worker.models.chunked_loss import chunk_rows, chunked_cross_entropy
from dilocox.worker.models.contract import causal_lm_loss

CPU = torch.device("cpu")


def logits_and_targets(tokens: int, vocab: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) * 3).to(dtype)
    return logits, torch.randint(0, vocab, (tokens,), generator=g)


@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
def test_gradient_is_the_plain_losss_bit_for_bit(rows):
    logits, targets = logits_and_targets(257, 1024)  # 257 rows: the last piece shorter than the others
    targets[::10] = -100  # ignored targets are left out of the mean, as F.cross_entropy does
    plain = logits.clone().requires_grad_()
    chunked = logits.clone().requires_grad_()
    want = F.cross_entropy(plain.float(), targets)
    got = chunked_cross_entropy(chunked, targets, rows=rows)
    grad = torch.tensor(0.37)  # the schedule's or the caller's upstream gradient, whatever it is
    want.backward(grad)
    got.backward(grad)
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()  # summed in another order: a few ulp at most
    assert chunked.grad.dtype == torch.bfloat16 and torch.equal(chunked.grad, plain.grad)


def test_the_trainers_loss_chunks_low_precision_logits_and_keeps_fp32_as_it_was():
    logits, targets = logits_and_targets(4, 96, torch.float32)
    batch = logits.reshape(2, 2, 96), targets.reshape(2, 2)
    assert torch.equal(causal_lm_loss(*batch), F.cross_entropy(logits, targets))  # fp32: the same call as before
    low = logits.bfloat16().reshape(2, 2, 96).requires_grad_()
    with torch.no_grad():  # eval: no graph, the same value
        assert (
            abs(float(causal_lm_loss(low, batch[1])) - float(F.cross_entropy(low.float().reshape(4, 96), targets)))
            < 1e-6
        )


def test_pieces_are_bounded_by_bytes_not_by_tokens():
    assert chunk_rows(128_256) == 64 * 2**20 // (4 * 128_256)  # Llama-3's vocabulary: 130 tokens of fp32 logits, 64 MiB
    assert chunk_rows(10**9) == 1  # a vocabulary past the budget still advances a token at a time


def peak_bytes(run) -> int:  # noqa: ANN001
    tracker = MemTracker()
    with tracker:
        run()
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"]


def test_the_microbatchs_logits_never_exist_in_fp32():
    """Forward and backward of the loss over [2048, 8192] bf16 logits (32 MiB; 64 MiB in fp32): the plain
    loss peaks at three fp32 copies (the upcast, the log-softmax it keeps, the gradient) on top of the bf16
    logits; the chunked one at the bf16 logits and their bf16 gradient plus a few pieces."""
    tokens, vocab, rows = 2048, 8192, 256
    logits, targets = logits_and_targets(tokens, vocab)
    bf16_bytes, fp32_bytes, piece_bytes = tokens * vocab * 2, tokens * vocab * 4, rows * vocab * 4

    def plain():
        F.cross_entropy(held.float(), targets).backward()

    def chunked():
        chunked_cross_entropy(held, targets, rows=rows).backward()

    held = logits.clone().requires_grad_()
    plain_peak = peak_bytes(plain)
    held = logits.clone().requires_grad_()
    chunked_peak = peak_bytes(chunked)  # counts the logits it keeps for the backward (the plain loss keeps none)
    assert plain_peak >= 3 * fp32_bytes
    assert chunked_peak <= 2 * bf16_bytes + 6 * piece_bytes  # measured: 2 × bf16 + 5 pieces
    assert chunked_peak < (plain_peak + bf16_bytes) / 2  # measured 109 MB against 235 MB
