"""Payload codecs: how a tensor slice becomes bytes and back (before zstd framing).

Pure functions keyed by a codec name that travels in every frame, so a shard decodes whatever each
client chose. `fp32` is lossless; `fp16`/`bf16` are plain casts; `int8`/`int4` are blockwise absmax
quantisation (`common.quantize`, self-describing payloads); low-rank codecs register here under their
own names. Every decode refuses NaN/Inf: a non-finite pseudo-gradient would poison the
global model of every cluster, so it is treated as malformed input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from dilocox.common.wire.errors import InvalidFrame, UnknownCodec
from dilocox.common.wire.finite import all_finite
from dilocox.common.wire.lowrank import (
    OrderedProduct,
    as_matrix_shape,
    decode_lowrank,
    encode_lowrank,
    lowrank_header_shape,
    max_lowrank_bytes,
    power_iteration,
    vetted_factors,
)
from dilocox.common.wire.quantize import decode_quantized, encode_quantized, quantized_nbytes


class Codec(NamedTuple):
    encode: Callable[[torch.Tensor], tuple[bytes | memoryview, str]]
    decode: Callable[[bytearray, str, tuple[int, ...]], torch.Tensor]
    max_payload_bytes: Callable[[tuple[int, ...]], int]


# Raw little-endian floats: (torch dtype, dtype name in the frame, integer view for numpy's buffer).
_RAW_DTYPES = {
    "fp32": (torch.float32, "float32", torch.int32),
    "fp16": (torch.float16, "float16", torch.int16),
    "bf16": (torch.bfloat16, "bfloat16", torch.int16),
}
QUANT_BLOCK = 128  # block size this build's encoders use; decoders accept any block a payload declares


def _raw_codec(name: str) -> Codec:
    torch_dtype, dtype_name, int_view = _RAW_DTYPES[name]
    itemsize = torch.finfo(torch_dtype).bits // 8
    limit = torch.finfo(torch_dtype).max

    def encode(tensor: torch.Tensor) -> tuple[memoryview, str]:
        flat = tensor.detach().to(dtype=torch.float32, device="cpu").reshape(-1)
        if torch_dtype is not torch.float32:
            # Finite values beyond the format's range saturate (fp16: ±65504) rather than become Inf,
            # which every decoder would refuse. NaN/Inf pass through unchanged, so the receiver
            # refuses them as it would for fp32.
            flat = torch.where(torch.isfinite(flat), flat.clamp(-limit, limit), flat)
        raw = flat.to(torch_dtype).contiguous()
        return memoryview(raw.view(int_view).numpy()).cast("B"), dtype_name

    def decode(buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        if dtype != dtype_name:
            raise InvalidFrame(f"codec {name} carries {dtype_name}, frame says {dtype!r}")
        numel = math.prod(shape)
        if len(buffer) != itemsize * numel:
            raise InvalidFrame(f"{name} payload of {len(buffer)} bytes does not hold shape {list(shape)}")
        if numel == 0:
            return torch.empty(shape, dtype=torch.float32)
        return torch.frombuffer(buffer, dtype=torch_dtype).to(torch.float32).reshape(shape)

    return Codec(encode, decode, lambda shape: itemsize * math.prod(shape))


def _quant_codec(name: str, bits: int) -> Codec:
    def encode(tensor: torch.Tensor) -> tuple[bytes, str]:
        return encode_quantized(tensor, bits, block=QUANT_BLOCK), name

    def decode(buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        if dtype != name:
            raise InvalidFrame(f"codec {name} carries {name}, frame says {dtype!r}")
        values, end = decode_quantized(buffer, 0)
        numel = math.prod(shape)
        if values.numel() != numel:
            raise InvalidFrame(f"{name} payload holds {values.numel()} values, shape {list(shape)} needs {numel}")
        if end != len(buffer):
            raise InvalidFrame(f"{name} payload has {len(buffer) - end} trailing bytes")
        return values.reshape(shape)

    # A client may choose any block size; block 1 (one scale per value) gives the largest payload.
    return Codec(encode, decode, lambda shape: quantized_nbytes(math.prod(shape), bits, 1))


def _encode_lowrank_stateless(tensor: torch.Tensor) -> tuple[bytes, str]:
    """A one-shot rank-≤4 encoding from a fixed seed; training uses the stateful `TensorCompressor`."""
    rows, cols = as_matrix_shape(tuple(tensor.shape))
    matrix = tensor.detach().to(torch.float32).reshape(rows, cols)
    start = torch.randn(cols, min(4, rows, cols), generator=torch.Generator().manual_seed(0))
    p, q = power_iteration(matrix, start)
    return encode_lowrank(p, q, factor_bits=8), "float32"


def _check_lowrank_frame(buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> None:
    """What the frame says of a low-rank payload must agree with the payload's own header."""
    if dtype != "float32":
        raise InvalidFrame(f"codec lowrank reconstructs float32, frame says {dtype!r}")
    if len(shape) < 2:
        raise InvalidFrame(f"codec lowrank needs a shape of ≥ 2 dimensions, got {list(shape)}")
    if lowrank_header_shape(buffer) != as_matrix_shape(shape):
        raise InvalidFrame(f"low-rank payload is {lowrank_header_shape(buffer)}, frame shape {list(shape)}")


def _decode_lowrank(buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    _check_lowrank_frame(buffer, dtype, shape)
    return decode_lowrank(buffer).reshape(shape)


def _max_lowrank_bytes(shape: tuple[int, ...]) -> int:
    if len(shape) < 2:
        raise InvalidFrame(f"codec lowrank needs a shape of ≥ 2 dimensions, got {list(shape)}")
    return max_lowrank_bytes(shape)


CODECS: dict[str, Codec] = {
    "fp32": _raw_codec("fp32"),
    "lowrank": Codec(_encode_lowrank_stateless, _decode_lowrank, _max_lowrank_bytes),
    "fp16": _raw_codec("fp16"),
    "bf16": _raw_codec("bf16"),
    "int8": _quant_codec("int8", 8),
    "int4": _quant_codec("int4", 4),
}


def check_known(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise UnknownCodec(f"unknown codec {name!r}; this build decodes {sorted(CODECS)}") from None


def encode(name: str, tensor: torch.Tensor) -> tuple[bytes | memoryview, str]:
    return check_known(name).encode(tensor)


def _check_shape(shape: tuple[int, ...]) -> None:
    if any(d < 0 for d in shape):
        raise InvalidFrame(f"negative dimension in shape {list(shape)}")


def decode(name: str, buffer: bytearray, dtype: str, shape: tuple[int, ...], vetted: bool = False) -> torch.Tensor:
    """The payload's values; refused (InvalidFrame) unless every one is finite. `vetted`: this very
    buffer passed `vet` and nothing has written to it since, so the finiteness pass (a read of every
    value: for fp32 the whole cost of a decode to a view) is not run again."""
    _check_shape(shape)
    tensor = check_known(name).decode(buffer, dtype, shape)
    if name != "lowrank" and not vetted and not all_finite(tensor):  # a low-rank decode is vetted on its factors first
        raise InvalidFrame(f"{name} payload holds NaN or Inf values")
    return tensor


def decode_lazy(
    name: str, buffer: bytearray, dtype: str, shape: tuple[int, ...], vetted: bool = False
) -> torch.Tensor | OrderedProduct:
    """`decode`, except that a low-rank payload comes back as its `OrderedProduct` (vetted, the factors
    only): the round's mean builds it block by block, never as a dense tensor (`aggregation.apply_round`).
    Factors are re-checked even when `vetted`: that costs a pass over the factors, not the product."""
    if name != "lowrank":
        return decode(name, buffer, dtype, shape, vetted)
    _check_shape(shape)
    _check_lowrank_frame(buffer, dtype, shape)
    return OrderedProduct(*vetted_factors(buffer))


def vet(name: str, buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> None:
    """Refuse exactly what `decode` would refuse, as cheaply as the codec allows: a low-rank payload is
    checked on its factors (a bound on the product, see `lowrank.vetted_factors`), not decoded — on a
    shard and on every cluster that is a dense decode per contribution per round saved; other codecs
    decode (an fp32 payload to a view) and drop the result. Both are `decode_lazy`, result dropped."""
    decode_lazy(name, buffer, dtype, shape)


def max_payload_bytes(name: str, shape: tuple[int, ...]) -> int:
    return check_known(name).max_payload_bytes(shape)
