"""Low-rank payloads: PowerSGD-style factors P (n×r) and Q (m×r) of a matrix, quantised, and back.

Pure functions. The stateful part — the warm-start Q carried from round to round, the rank choice,
error feedback — lives in `common.compression`; this module only turns given factors into bytes and
bytes into the dense reconstruction P·Qᵀ. The payload is self-describing (magic, version, shape, rank,
factor quantiser), so a shard decodes any client's choice from the bytes alone.

Layout (little-endian):  header  |  P payload  |  Q payload
where each factor payload is raw float32 (factor_bits = 32) or a `common.quantize` payload (8 or 4).
Version 2 (what this build writes) stores each factor transposed, component by component (Pᵀ, Qᵀ),
with one quantisation block per component (`factor_block`): a weak component gets a scale of its own
instead of the strongest one's. Against version 1 (row-major factors in blocks of 128, still decoded)
that measured less quantisation error in P·Qᵀ for fewer bytes after zstd (docs/decisions.md).
"""

from __future__ import annotations

import math
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from dilocox.common.wire.errors import InvalidFrame, UnknownCodec
from dilocox.common.wire.finite import all_finite
from dilocox.common.wire.quantize import decode_quantized, encode_quantized, quantized_nbytes

try:  # the compiled decode (setup.py builds it where a C compiler is there); else the torch form
    from dilocox.common.wire import _kernels
except ImportError:  # pragma: no cover - depends on the install
    _kernels = None

LOWRANK_VERSION = 2  # what this build writes
DECODED_VERSIONS = (1, 2)
_MAGIC = 0xC5
_HEADER = struct.Struct("<BBBxIII")  # magic, version, factor_bits, pad, rows, cols, rank
FACTOR_BITS = (32, 8, 4)
MAX_COMPONENT_BLOCK = 1024  # longer components are quantised in blocks of 256


def power_iteration(matrix: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration from warm start `q` (m×k): P = orth(M Q), Q' = Mᵀ P. Returns (P, Q').

    Both products are taken with the thin factor on the left, (Qᵀ Mᵀ)ᵀ and (Pᵀ M)ᵀ: the same sums, but
    CPU BLAS (MKL on AMD in particular) runs a skinny M Q at a fifth and Mᵀ P at a tenth of that
    layout's speed (docs/performance.md, `dilocox bench exchange`). The encoder need not be bit-exact
    anywhere: what it sends is decoded by one exact rule."""
    p = (q.T @ matrix.T).T
    p, _ = torch.linalg.qr(p, mode="reduced")
    return p, (p.T @ matrix).T


def ordered_factors(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate (P, Q) so that components come in decreasing strength; returns (P', Q', singular values).

    P has orthonormal columns, so P Qᵀ = P V S Uᵀ with Q = U S Vᵀ: the k-th column pair of
    (P V, U S) is the k-th strongest rank-1 component, and truncating to r columns keeps the best
    rank-r approximation within this subspace.
    """
    u, s, vh = torch.linalg.svd(q, full_matrices=False)
    return p @ vh.T, u * s, s


def factor_block(length: int) -> int:
    """Values per absmax scale in a version-2 factor whose components are `length` long: the whole
    component (one scale each, never shared with a neighbour), or 256 for components over 1024."""
    return max(1, length) if length <= MAX_COMPONENT_BLOCK else 256


def _encode_factor(x: torch.Tensor, bits: int) -> bytes:
    """`x` is a factor transposed: one component per row."""
    if bits == 32:
        return x.to(torch.float32).contiguous().numpy().tobytes()
    return encode_quantized(x, bits, factor_block(x.shape[1]))


def _decode_factor(buffer, offset: int, numel: int, bits: int) -> tuple[torch.Tensor, int]:
    if bits == 32:
        end = offset + 4 * numel
        if end > len(buffer):
            raise InvalidFrame(f"low-rank payload truncated: factor needs {4 * numel} bytes at offset {offset}")
        t = torch.frombuffer(bytearray(buffer[offset:end]), dtype=torch.float32) if numel else torch.empty(0)
        return t, end
    t, end = decode_quantized(buffer, offset)
    if t.numel() != numel:
        raise InvalidFrame(f"low-rank factor holds {t.numel()} values, header implies {numel}")
    return t, end


def encode_lowrank(p: torch.Tensor, q: torch.Tensor, factor_bits: int = 4) -> bytes:
    """Bytes of the factors P (n×r) and Q (m×r); the receiver reconstructs P Qᵀ (n×m)."""
    if factor_bits not in FACTOR_BITS:
        raise ValueError(f"factor_bits must be one of {FACTOR_BITS}, got {factor_bits}")
    if p.dim() != 2 or q.dim() != 2 or p.shape[1] != q.shape[1]:
        raise ValueError(f"factors must be n×r and m×r, got {tuple(p.shape)} and {tuple(q.shape)}")
    rows, rank = p.shape
    cols = q.shape[0]
    header = _HEADER.pack(_MAGIC, LOWRANK_VERSION, factor_bits, rows, cols, rank)
    return header + _encode_factor(p.T.contiguous(), factor_bits) + _encode_factor(q.T.contiguous(), factor_bits)


def lowrank_nbytes(rows: int, cols: int, rank: int, factor_bits: int = 4) -> int:
    """Exact length of `encode_lowrank` output for n×r and m×r factors, without encoding any: the layout
    is fixed (no entropy coding here), so a byte count at a model's size (`bench projection`) is arithmetic
    instead of thousands of encodes of zero factors."""
    if factor_bits not in FACTOR_BITS:
        raise ValueError(f"factor_bits must be one of {FACTOR_BITS}, got {factor_bits}")
    if factor_bits == 32:
        return _HEADER.size + 4 * (rows + cols) * rank
    p_bytes = quantized_nbytes(rank * rows, factor_bits, factor_block(rows))
    return _HEADER.size + p_bytes + quantized_nbytes(rank * cols, factor_bits, factor_block(cols))


def decode_lowrank(buffer: bytes | bytearray | memoryview) -> torch.Tensor:
    """The dense n×m reconstruction P Qᵀ of a low-rank payload (one dense tensor, in a fixed order),
    refused (`InvalidFrame`) where `vetted_factors` refuses it."""
    return OrderedProduct(*vetted_factors(buffer)).dense()


# Largest |P Qᵀ| bound a payload may have: below it, every partial sum of the ordered product is finite
# in fp32 (max ≈ 2^128), so a payload can be vetted without building the product.
_SAFE_BOUND = 2.0**120


def vetted_factors(buffer: bytes | bytearray | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
    """(Pᵀ, Qᵀ) of a payload whose decode is finite, checked without decoding it: its factors must be
    finite and Σₖ max|pₖ|·max|qₖ| (a bound on every element of P Qᵀ and on every partial sum of the
    ordered product) below 2^120. A real pseudo-gradient is some 30 orders of magnitude below that."""
    p_t, q_t = lowrank_factors(buffer)
    if not (all_finite(p_t) and all_finite(q_t)):
        raise InvalidFrame("low-rank payload holds NaN or Inf factors")
    if p_t.numel() and q_t.numel():
        bound = float((p_t.abs().amax(dim=1).double() * q_t.abs().amax(dim=1).double()).sum())
        if not bound < _SAFE_BOUND:
            raise InvalidFrame(f"low-rank payload would overflow fp32 (|P Qᵀ| up to {bound:.3g})")
    return p_t, q_t


def lowrank_factors(buffer: bytes | bytearray | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
    """(Pᵀ, Qᵀ) of a low-rank payload, rank × rows and rank × cols, after checking its framing."""
    if len(buffer) < _HEADER.size:
        raise InvalidFrame(f"low-rank payload of {len(buffer)} bytes is shorter than its header")
    magic, version, bits, rows, cols, rank = _HEADER.unpack_from(buffer, 0)
    if magic != _MAGIC:
        raise InvalidFrame(f"not a low-rank payload (magic {magic:#x})")
    if version not in DECODED_VERSIONS:
        raise UnknownCodec(f"low-rank payload version {version}; this build decodes versions {DECODED_VERSIONS}")
    if bits not in FACTOR_BITS:
        raise InvalidFrame(f"low-rank factor quantiser of {bits} bits is not one of {FACTOR_BITS}")
    if rank > min(rows, cols):
        raise InvalidFrame(f"rank {rank} exceeds min(rows, cols) = {min(rows, cols)}")
    p, offset = _decode_factor(buffer, _HEADER.size, rows * rank, bits)
    q, offset = _decode_factor(buffer, offset, cols * rank, bits)
    if offset != len(buffer):
        raise InvalidFrame(f"low-rank payload has {len(buffer) - offset} trailing bytes")
    if version == 1:  # row-major factors
        return p.reshape(rows, rank).T, q.reshape(cols, rank).T
    return p.reshape(rank, rows), q.reshape(rank, cols)


# Elements of the product built per step: a step's torch calls cost little next to their arithmetic, and
# the step's sum and one term's scratch stay in a core's L2 cache.
PRODUCT_STEP_ELEMENTS = 1 << 17


class OrderedProduct:
    """P Qᵀ (P: n×r, Q: m×r, given as their r×n and r×m transposes), built on demand by rows as the sum
    of its rank-1 terms in order, p₀q₀ᵀ + p₁q₁ᵀ + …, each product and each addition one rounded fp32
    operation.

    A BLAS matmul sums the r products in an order (and with fused multiply-adds) that depends on the
    CPU's vector width and the library, so a shard and a cluster on different machines — or a cluster
    on a GPU — would decode the same payload to tensors that differ in the last bit, and the replayed
    outer step would drift. Elementwise IEEE multiplies and adds round the same everywhere.

    Two forms with the same bits: the compiled kernel (`_kernels.c`: the partial sums stay in registers,
    no GIL held, rows split over the calling thread's torch thread count), and, where it was not built,
    torch — per step of rows, a multiply for the first term, then a multiply into scratch and an
    in-place add for each next one. No product-sized tensor unless the caller asks for one
    (docs/decisions.md, "Replay check", and "The exchange at the hardware's speed": "A compiled decode")."""

    def __init__(self, p_t: torch.Tensor, q_t: torch.Tensor, compiled: bool = True) -> None:
        self.rank, self.rows = p_t.shape
        self.cols = q_t.shape[1]
        self._p = p_t.to(torch.float32).T.contiguous()  # rows × rank
        self._q = q_t.to(torch.float32).contiguous()
        self.step_rows = max(1, PRODUCT_STEP_ELEMENTS // max(1, self.cols))
        self.compiled = compiled and _kernels is not None and self.rank > 0
        self._term = torch.empty(0)

    def rows_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [start, stop) of the product written into `out` ((stop − start) × cols); returns it."""
        if self.rank == 0:
            return out.zero_()
        if self.compiled and out.is_contiguous():
            self._kernel(start, stop, out, subtract=False)
            return out
        if self._term.numel() < min(self.step_rows, stop - start) * self.cols:
            self._term = torch.empty(min(self.step_rows, stop - start) * self.cols)
        for first in range(start, stop, self.step_rows):
            last = min(stop, first + self.step_rows)
            block = out[first - start : last - start]
            term = self._term[: (last - first) * self.cols].view(last - first, self.cols)
            torch.mul(self._p[first:last, 0:1], self._q[0], out=block)
            for i in range(1, self.rank):
                block.add_(torch.mul(self._p[first:last, i : i + 1], self._q[i], out=term))
        return out

    def _kernel(self, start: int, stop: int, out: torch.Tensor, subtract: bool) -> None:
        """The compiled form over rows [start, stop) into `out` (contiguous), split over this thread's
        torch thread count where the rows are many: the kernel holds no GIL, so Python threads run it
        side by side."""
        p, q, target = self._p.numpy(), self._q.numpy(), out.numpy()
        parts = min(torch.get_num_threads(), max(1, (stop - start) * self.cols // PRODUCT_STEP_ELEMENTS), stop - start)
        bounds = [start + (stop - start) * i // parts for i in range(parts + 1)]

        def run(a, b):
            return _kernels.ordered_rows(p, q, self.rank, self.cols, a, b, target[a - start : b - start], subtract)

        others = [_pool().submit(run, a, b) for a, b in zip(bounds[1:-1], bounds[2:])] if parts > 1 else []
        run(bounds[0], bounds[1])
        for future in others:
            future.result()

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, Qᵀ): rows × rank and rank × cols, as held (for inner products that need no product)."""
        return self._p, self._q

    def dense(self) -> torch.Tensor:
        """The whole product as one rows × cols tensor."""
        return self.rows_into(0, self.rows, torch.empty(self.rows, self.cols))

    def subtract_from(self, target: torch.Tensor) -> None:
        """`target −= P Qᵀ` in place, with the bits of `target − self.dense()`: each step of the product
        is subtracted while it is in cache (the compiled form: as it is summed)."""
        matrix = target.view(self.rows, self.cols)
        if self.compiled and matrix.is_contiguous():
            self._kernel(0, self.rows, matrix, subtract=True)
            return
        scratch = torch.empty(min(self.step_rows, self.rows), self.cols)
        for start in range(0, self.rows, self.step_rows):
            stop = min(self.rows, start + self.step_rows)
            matrix[start:stop].sub_(self.rows_into(start, stop, scratch[: stop - start]))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """Threads that run parts of a compiled decode beside the calling thread: one per core at most."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="lowrank-decode")
        return _POOL


def ordered_product(p_t: torch.Tensor, q_t: torch.Tensor) -> torch.Tensor:
    """P Qᵀ as the ordered sum of its rank-1 terms (`OrderedProduct`), as one tensor."""
    return OrderedProduct(p_t, q_t).dense()


def lowrank_header_shape(buffer) -> tuple[int, int]:
    """(rows, cols) a payload declares, to check against the frame's shape before decoding."""
    if len(buffer) < _HEADER.size:
        raise InvalidFrame(f"low-rank payload of {len(buffer)} bytes is shorter than its header")
    _, _, _, rows, cols, _ = _HEADER.unpack_from(buffer, 0)
    return rows, cols


def as_matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """How an N-d slice is viewed as a matrix: first dimension × the rest."""
    if len(shape) < 2:
        raise ValueError(f"low-rank needs at least 2 dimensions, got shape {list(shape)}")
    return shape[0], math.prod(shape[1:])


def max_lowrank_bytes(shape: tuple[int, ...]) -> int:
    """Largest legal payload for a slice of `shape`: full rank, the widest factor encoding."""
    rows, cols = as_matrix_shape(shape)
    rank = min(rows, cols)
    widest = max(4 * (rows + cols) * rank, quantized_nbytes(rows * rank, 8, 1) + quantized_nbytes(cols * rank, 8, 1))
    return _HEADER.size + widest
