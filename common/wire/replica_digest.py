"""A digest of the global state a shard holds for some slices, so a cluster can check its replay.

On the way back a shard forwards the round's contributions and every cluster replays the outer step on
its own copy (docs/decisions.md, "Downlink"). The replay equals the shard bit for bit only where both
run the same arithmetic on the same kind of CPU and torch build. Sites are not like that (other CPUs,
other BLAS kernels, another torch), so the shard sends, with the contributions, one sha256 over the
weights and the outer momentum it holds for the requested slices; the cluster computes the same over
its replay and pulls the slices in full when they differ.

Pure functions over CPU tensors; shard and cluster call exactly these.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch

from dilocox.common.wire.framing import SliceKey

DIGEST_BYTES = 32  # sha256
_NO_MOMENTUM = b"no-momentum"


def slice_digest(key: SliceKey, weights: torch.Tensor, momentum: torch.Tensor | None) -> bytes:
    """sha256 over the slice's name and rows, its fp32 weights and its outer momentum (if it has any)."""
    h = hashlib.sha256(f"{key.name}\0{key.row_start}\0{key.row_stop}\0".encode())
    for tensor in (weights, momentum):
        if tensor is None:
            h.update(_NO_MOMENTUM)
            continue
        flat = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        h.update(str(tuple(tensor.shape)).encode())
        h.update(flat.numpy().data if flat.numel() else b"")
    return h.digest()


def combined_digest(per_slice: Mapping[SliceKey, bytes]) -> bytes:
    """One sha256 over the per-slice digests in sorted key order: 32 bytes for any number of slices."""
    return hashlib.sha256(b"".join(per_slice[key] for key in sorted(per_slice))).digest()


def state_digest(
    keys: list[SliceKey], weights: Mapping[SliceKey, torch.Tensor], momentum: Mapping[SliceKey, torch.Tensor]
) -> bytes:
    """The combined digest of `keys`' weights and momentum."""
    return combined_digest({key: slice_digest(key, weights[key], momentum.get(key)) for key in keys})
