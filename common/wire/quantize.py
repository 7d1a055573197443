"""Blockwise absmax quantisation of float tensors to int8 / int4: tensor in, self-describing bytes out.

Layout of one payload (all little-endian), version `QUANT_VERSION`:

    header  struct "<BBBIQ" (15 bytes): magic 0xD7, version, bits (8 or 4), block (uint32), numel (uint64)
    scales  ceil(numel / block) float32: absmax(block) / qmax, qmax = 127 (int8) or 7 (int4); 0 for a zero block
    codes   int8: numel int8 in [-127, 127]
            int4: numel signed values in [-7, 7], stored as value + 8 in one nibble each, two per byte
                  (low nibble = even index); for odd numel the last byte's high nibble is 0

Encoding rounds to nearest (torch.round, ties to even), never stochastically. Decoding is one float32
multiply per element (code × its block's scale), so the same bytes give the same tensor bit for bit on
every machine: the server and all clients reconstruct identical weights. A payload carries its own
length, so several can lie back to back in one buffer (`decode_quantized` returns the offset after it).

Every refusal of malformed bytes is an `InvalidFrame` (an unknown version is an `UnknownCodec`), and
every length is checked against the buffer before anything is allocated, so hostile headers cannot make
a shard allocate more than the bytes it actually received justify.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from dilocox.common.wire.errors import InvalidFrame, UnknownCodec
from dilocox.common.wire.finite import all_finite

QUANT_VERSION = 1
MAGIC = 0xD7
_HEADER = struct.Struct("<BBBIQ")  # magic, version, bits, block, numel
HEADER_BYTES = _HEADER.size  # 15
_MAX_BLOCK = 2**32 - 1
_QMAX = {8: 127, 4: 7}


def _qmax(bits: int) -> int:
    if isinstance(bits, bool) or bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return _QMAX[bits]


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= _MAX_BLOCK:
        raise ValueError(f"block must be an int in [1, {_MAX_BLOCK}], got {block!r}")


def _num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def quantized_nbytes(numel: int, bits: int, block: int = 128) -> int:
    """Exact length of `encode_quantized` output for `numel` values."""
    _qmax(bits)
    _check_block(block)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return HEADER_BYTES + 4 * _num_blocks(numel, block) + _code_bytes(numel, bits)


def relative_error_bound(bits: int) -> float:
    """Per-element error bound relative to the block's absmax: 0.5/127 for int8, 0.5/7 for int4.

    For every element, |decode(encode(x)) − x| ≤ bound × absmax(block of x), up to float32 rounding
    (a relative slack of a few 2⁻²⁴ on top): each value is rounded to the nearest multiple of
    scale = absmax / qmax, so it moves by at most half a step, and the block's absmax itself lies on
    the grid (code ±qmax). Blocks whose absmax is so small that absmax / qmax underflows float32's
    normal range (< ~1.5e-36) lose this guarantee: their scale is subnormal or zero.
    """
    return 0.5 / _qmax(bits)


def _per_block(values: torch.Tensor, block: int, per_block: torch.Tensor, op) -> torch.Tensor:
    """op(values[i], per_block[i // block]) for a flat tensor, without padding to a whole block.

    Full blocks are a (full, block) view broadcast against a column; the partial tail block (if any)
    uses the last entry. Allocation stays O(numel) whatever `block` is.
    """
    full = values.numel() // block
    head = op(values[: full * block].view(full, block), per_block[:full, None]).reshape(-1)
    tail = op(values[full * block :], per_block[full:])
    return torch.cat([head, tail])


def encode_quantized(x: torch.Tensor, bits: int, block: int = 128) -> bytes:
    """Quantise `x` (any shape, any float dtype; flattened, as float32) into one self-describing payload."""
    qmax = _qmax(bits)
    _check_block(block)
    flat = x.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    numel = flat.numel()
    if not all_finite(flat):
        raise ValueError("cannot quantise a tensor holding NaN or Inf")
    full = numel // block
    absmax_parts = [flat[: full * block].view(full, block).abs().amax(dim=1)]
    if numel > full * block:
        absmax_parts.append(flat[full * block :].abs().amax().reshape(1))
    scales = torch.cat(absmax_parts) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero block: x/1 = 0 → code 0
    codes = torch.round(_per_block(flat, block, safe, torch.div)).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 8:
        code_bytes = codes.numpy().tobytes()
    else:
        nibbles = (codes + 8).to(torch.uint8)
        if numel % 2:
            nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8)])
        code_bytes = (nibbles[0::2] | (nibbles[1::2] << 4)).numpy().tobytes()
    header = _HEADER.pack(MAGIC, QUANT_VERSION, bits, block, numel)
    return b"".join([header, scales.numpy().astype("<f4").tobytes(), code_bytes])


def decode_quantized(buffer: bytes | bytearray | memoryview, offset: int = 0) -> tuple[torch.Tensor, int]:
    """Parse one payload at `offset`; return (1-D float32 tensor of numel values, offset just past it).

    Raises InvalidFrame for a malformed payload (magic, bits, block, lengths beyond the buffer,
    non-finite or negative scales, codes outside [-qmax, qmax], non-zero int4 padding, values that
    overflow float32) and UnknownCodec for a version this build does not know.
    """
    view = memoryview(buffer).cast("B")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    available = len(view) - offset
    if available < HEADER_BYTES:
        raise InvalidFrame(
            f"quantised payload at offset {offset}: {max(available, 0)} bytes, header needs {HEADER_BYTES}"
        )
    magic, version, bits, block, numel = _HEADER.unpack_from(view, offset)
    if magic != MAGIC:
        raise InvalidFrame(f"quantised payload at offset {offset}: bad magic 0x{magic:02X} (expected 0x{MAGIC:02X})")
    if version != QUANT_VERSION:
        raise UnknownCodec(f"quantised payload version {version}; this build decodes version {QUANT_VERSION}")
    if bits not in _QMAX:
        raise InvalidFrame(f"quantised payload declares {bits} bits (only 8 and 4 exist)")
    if block == 0:
        raise InvalidFrame("quantised payload declares block size 0")
    qmax = _QMAX[bits]
    nblocks = _num_blocks(numel, block)
    ncode = _code_bytes(numel, bits)
    end = offset + HEADER_BYTES + 4 * nblocks + ncode
    if end > len(view):  # checked before any allocation: numel/scales/codes must fit in what arrived
        raise InvalidFrame(
            f"quantised payload declares {numel} values in blocks of {block} ({end - offset} bytes), "
            f"buffer holds {available} from offset {offset}"
        )
    pos = offset + HEADER_BYTES
    scales = torch.from_numpy(np.frombuffer(view, dtype="<f4", count=nblocks, offset=pos).astype(np.float32))
    if nblocks and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise InvalidFrame("quantised payload holds a NaN, Inf or negative block scale")
    pos += 4 * nblocks
    raw = torch.from_numpy(np.frombuffer(view, dtype=np.uint8, count=ncode, offset=pos).copy())
    if bits == 8:
        codes = raw.view(torch.int8)
        if numel and bool((codes == -128).any()):
            raise InvalidFrame(f"int8 code -128 is outside [-{qmax}, {qmax}]")
    else:
        nibbles = torch.stack([raw & 0x0F, raw >> 4], dim=1).reshape(-1)
        if numel % 2 and int(nibbles[-1]) != 0:
            raise InvalidFrame("int4 payload: padding nibble of odd-length codes is not 0")
        nibbles = nibbles[:numel]
        if numel and bool((nibbles == 0).any()):
            raise InvalidFrame(f"int4 code -8 is outside [-{qmax}, {qmax}]")
        codes = nibbles.to(torch.int8) - 8
    values = _per_block(codes.to(torch.float32), block, scales, torch.mul)
    if not all_finite(values):
        raise InvalidFrame("quantised payload decodes to values beyond float32 range")
    return values, end
