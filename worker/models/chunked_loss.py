"""Cross-entropy over bf16 logits without ever holding them whole in fp32.

At a 128k vocabulary one microbatch of 4,096 tokens has 0.5G logits: 1 GB in bf16, but 2 GB for each fp32
copy the plain `F.cross_entropy(logits.float(), …)` makes — the upcast, the log-softmax it keeps for the
backward, and the gradient it forms — about 6 GB per microbatch on the last stage, more than the stage's
weights at pp ≥ 8. Here the loss is taken `rows` tokens at a time: each piece is upcast, reduced and
dropped in the forward (nothing kept but the bf16 logits, which autograd holds anyway), and recomputed
piece by piece in the backward, which writes the gradient straight into one tensor of the logits' dtype.

The per-element arithmetic is the plain loss's — the same log-softmax, the same `−g/N` at the targets, the
same cast back — so the gradient is equal bit for bit (tests/test_chunked_loss.py); only the loss *value*
is summed in another order (a few ulp). fp32 logits keep the plain path (`worker/models/contract.py`),
so runs in fp32 end on the same bits as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_BYTES = 64 * 2**20  # fp32 bytes of one piece of logits: bounds the loss's transient memory
IGNORE_INDEX = -100  # F.cross_entropy's default, kept so the mean is over the same targets


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per piece: as many as fit `chunk_bytes` of fp32 logits, at least one."""
    return max(1, chunk_bytes // (4 * vocab))


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy (nats, fp32) of `logits` [tokens, vocab] against `targets` [tokens], `rows`
    tokens at a time (default: `chunk_rows` of the vocabulary)."""
    return _ChunkedCrossEntropy.apply(logits, targets, rows or chunk_rows(logits.size(-1)))


def _pieces(n: int, rows: int) -> list[slice]:
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:  # noqa: ANN001
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for piece in _pieces(logits.size(0), rows):
            total += F.cross_entropy(logits[piece].float(), targets[piece], reduction="sum")
        count = (targets != IGNORE_INDEX).sum().to(torch.float32)
        ctx.save_for_backward(logits, targets, count)
        ctx.rows = rows
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        logits, targets, count = ctx.saved_tensors
        scale = grad / count  # what the plain mean's backward hands each target: −g/N
        out = torch.empty_like(logits)
        for piece in _pieces(logits.size(0), ctx.rows):
            with torch.enable_grad():
                upcast = logits[piece].detach().float().requires_grad_()
                loss = F.cross_entropy(upcast, targets[piece], reduction="sum")
                (part,) = torch.autograd.grad(loss, upcast, scale)
            out[piece] = part  # cast to the logits' dtype, as the plain path's upcast does in its backward
        return out, None, None
