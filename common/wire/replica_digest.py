"""A digest of the global state a shard holds for some slices, so a cluster can check its replay.

On the way back a shard forwards the round's contributions and every cluster replays the outer step on
its own copy (docs/decisions.md, "Downlink"). The replay equals the shard bit for bit only where both
run the same arithmetic on the same kind of CPU and torch build. Sites are not like that (other CPUs,
other BLAS kernels, another torch), so the shard sends, with the contributions, one digest over the
weights and the outer momentum it holds for the requested slices (hashed by the function the cluster's
pull names); the cluster computes the same over its replay and pulls the slices in full when they differ.

Pure functions over CPU tensors; shard and cluster call exactly these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

import torch
import xxhash

from dilocox.common.wire.framing import SliceKey

DIGEST_BYTES = 32  # what travels: sha256 over the per-slice digests, whatever hashed the slices
# How the slices' bytes are hashed. "xxh3-128" (what this build asks for): XXH3's 128-bit hash, ~10× the
# speed of sha256 on a core. The check guards against a replay that rounded differently, not against an
# adversary (the connection is authenticated), so a non-cryptographic 128-bit hash is enough; sha256
# stays for clusters from before, whose pull names no function (docs/decisions.md, "The exchange at the
# hardware's speed").
SHA256, XXH3_128 = "", "xxh3-128"
DIGESTS: dict[str, Callable[[], object]] = {SHA256: hashlib.sha256, XXH3_128: xxhash.xxh3_128}
_NO_MOMENTUM = b"no-momentum"
# Bytes hashed per call: xxhash holds the GIL while it hashes, so a slice of 100 MB in one call would stop
# the training thread for ~5 ms; 1 MB at a time lets it in every ~50 µs.
_UPDATE_BYTES = 1 << 20


def check_digest_name(name: str) -> str:
    if name not in DIGESTS:
        raise ValueError(f"unknown state digest {name!r}; this build knows {sorted(n or 'sha256' for n in DIGESTS)}")
    return name


def slice_digest(key: SliceKey, weights: torch.Tensor, momentum: torch.Tensor | None, digest: str = SHA256) -> bytes:
    """The `digest` hash over the slice's name and rows, its fp32 weights and its outer momentum (if it
    has any)."""
    h = DIGESTS[check_digest_name(digest)]()
    h.update(f"{key.name}\0{key.row_start}\0{key.row_stop}\0".encode())
    for tensor in (weights, momentum):
        if tensor is None:
            h.update(_NO_MOMENTUM)
            continue
        flat = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        h.update(str(tuple(tensor.shape)).encode())
        data = flat.numpy().data.cast("B") if flat.numel() else memoryview(b"")
        for start in range(0, len(data), _UPDATE_BYTES):  # the same digest as one update of all of it
            h.update(data[start : start + _UPDATE_BYTES])
    return h.digest()


def combined_digest(per_slice: Mapping[SliceKey, bytes]) -> bytes:
    """One sha256 over the per-slice digests in sorted key order: 32 bytes for any number of slices."""
    return hashlib.sha256(b"".join(per_slice[key] for key in sorted(per_slice))).digest()


def state_digest(
    keys: list[SliceKey],
    weights: Mapping[SliceKey, torch.Tensor],
    momentum: Mapping[SliceKey, torch.Tensor],
    digest: str = SHA256,
) -> bytes:
    """The combined digest of `keys`' weights and momentum, each slice hashed by `digest`."""
    return combined_digest({key: slice_digest(key, weights[key], momentum.get(key), digest) for key in keys})
