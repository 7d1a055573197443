"""Payload codecs: how a tensor slice becomes bytes and back (before zstd framing).

Pure functions keyed by a codec name that travels in every frame, so a shard decodes whatever each
client chose. Only the lossless `fp32` codec exists yet; quantising and low-rank codecs register here
under their own names. Every decode refuses NaN/Inf: a non-finite pseudo-gradient would poison the
global model of every cluster, so it is treated as malformed input.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from dilocox.common.errors import InvalidFrame, UnknownCodec


class Codec(NamedTuple):
    encode: Callable[[torch.Tensor], tuple[bytes | memoryview, str]]
    decode: Callable[[bytearray, str, tuple[int, ...]], torch.Tensor]
    max_payload_bytes: Callable[[tuple[int, ...]], int]


def _encode_fp32(tensor: torch.Tensor) -> tuple[memoryview, str]:
    flat = tensor.detach().to(dtype=torch.float32, device="cpu").contiguous().reshape(-1)
    return memoryview(flat.numpy()).cast("B"), "float32"


def _decode_fp32(buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype != "float32":
        raise InvalidFrame(f"codec fp32 carries float32, frame says {dtype!r}")
    numel = math.prod(shape)
    if len(buffer) != 4 * numel:
        raise InvalidFrame(f"fp32 payload of {len(buffer)} bytes does not hold shape {list(shape)}")
    if numel == 0:
        return torch.empty(shape, dtype=torch.float32)
    return torch.frombuffer(buffer, dtype=torch.float32).reshape(shape)


CODECS: dict[str, Codec] = {
    "fp32": Codec(_encode_fp32, _decode_fp32, lambda shape: 4 * math.prod(shape)),
}


def check_known(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise UnknownCodec(f"unknown codec {name!r}; this build decodes {sorted(CODECS)}") from None


def encode(name: str, tensor: torch.Tensor) -> tuple[bytes | memoryview, str]:
    return check_known(name).encode(tensor)


def decode(name: str, buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if any(d < 0 for d in shape):
        raise InvalidFrame(f"negative dimension in shape {list(shape)}")
    tensor = check_known(name).decode(buffer, dtype, shape)
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise InvalidFrame(f"{name} payload holds NaN or Inf values")
    return tensor


def max_payload_bytes(name: str, shape: tuple[int, ...]) -> int:
    return check_known(name).max_payload_bytes(shape)
