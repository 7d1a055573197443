"""A checkpoint's own integrity: one SHA-256 over everything it holds, computed when it is saved and
checked whenever it is read.

`torch.load` does not check the CRC-32 of a zip entry, and a float with flipped bits is still a float: a
shard resumed from a damaged file served wrong weights without a word, and saved them again as a fresh
checkpoint. The digest is over the *content* (the dict as the program sees it), not the file's bytes, so
it lives inside the file as one more field, and whatever damaged the file — disk, copy, a hand edit —
shows as a mismatch after loading, however torch lays the bytes out.

The walk is canonical: every value is hashed with a type tag and a length, so that no two different
states share a byte stream (`["ab"]` is not `["a", "b"]`, `1` is not `True` is not `"1"`), and dict keys
are taken in the order of their `repr`, so the insertion order (which pickling keeps but nobody relies
on) does not matter. A tensor is hashed as its dtype, shape and raw bytes, read through a uint8 view of
its memory (no copy for the contiguous tensors a checkpoint holds). A type the walk does not know is
refused at save, rather than hashed by a `repr` that might differ between processes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

ALGORITHM = "sha256"
FIELD = "integrity"  # the saved dict's field holding "sha256:<hex>"
# A signed shard checkpoint's signature over that digest (server/state/checkpoint_signing.py): like the digest
# itself, outside what is digested.
SIGNATURE_FIELD = "checkpoint_signature"


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as bytes, in row-major order: a view of its memory when it is contiguous."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)  # reshape: a 0-d tensor has no dtype view
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _walk(value: Any, h: hashlib._Hash) -> None:
    def tagged(tag: bytes, data: bytes | memoryview) -> None:
        h.update(tag + len(data).to_bytes(8, "little"))
        h.update(data)

    if isinstance(value, torch.Tensor):
        tagged(b"T", f"{value.dtype}{tuple(value.shape)}".encode())
        tagged(b"B", _tensor_bytes(value))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        tagged(b"b", memoryview(value).cast("B"))
    elif isinstance(value, str):
        tagged(b"s", value.encode("utf-8", "surrogatepass"))
    elif value is None or isinstance(value, (bool, int, float)):
        tagged(b"r", f"{type(value).__name__}:{value!r}".encode())
    elif isinstance(value, dict):
        h.update(b"d" + len(value).to_bytes(8, "little"))
        for key in sorted(value, key=repr):
            _walk(key, h)
            _walk(value[key], h)
    elif isinstance(value, (list, tuple)):
        h.update((b"l" if isinstance(value, list) else b"t") + len(value).to_bytes(8, "little"))
        for item in value:
            _walk(item, h)
    elif isinstance(value, (set, frozenset)):
        h.update(b"S" + len(value).to_bytes(8, "little"))
        for item in sorted(value, key=repr):
            _walk(item, h)
    else:
        raise TypeError(f"checkpoint integrity: cannot digest a {type(value).__name__} (add it to the canonical walk)")


def state_digest(state: Any) -> str:
    """ "sha256:<hex>" over the canonical walk of `state`; a dict's own `integrity` field (and signature) is
    left out, so a sealed state digests to the value it carries."""
    h = hashlib.sha256()
    if isinstance(state, dict) and (FIELD in state or SIGNATURE_FIELD in state):
        state = {k: v for k, v in state.items() if k not in (FIELD, SIGNATURE_FIELD)}
    _walk(state, h)
    return f"{ALGORITHM}:{h.hexdigest()}"


def seal(state: dict) -> dict:
    """The state with its digest as the `integrity` field (a shallow copy: the tensors are shared)."""
    return {**state, FIELD: state_digest(state)}


def check(state: dict) -> str | None:
    """None when the state matches the digest it carries; otherwise what is wrong, in a few words."""
    stored = state.get(FIELD)
    if not isinstance(stored, str) or not stored.startswith(f"{ALGORITHM}:"):
        return f"no {ALGORITHM} digest in the file (found {stored!r})"
    found = state_digest(state)
    if found != stored:
        return f"content does not match its digest (stored {stored[:19]}…, computed {found[:19]}…)"
    return None
