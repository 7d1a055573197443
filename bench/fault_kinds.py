"""The faults of `dilocox bench faults`: what one faulty site does to the slices it pushes.

Each kind turns a slice as encoded for the wire into the slice the faulty site sends instead, with the
same codec (a low-rank payload stays low rank, through its factors; a quantised or fp32 one is decoded,
changed and encoded again), so the shards see what such a site would push:

* ``scale`` — its update × 100 (a unit or learning-rate bug);
* ``sign`` — its update negated (a sign bug: the site climbs the loss);
* ``noise`` — Gaussian noise of the same norm, slice by slice (a data pipeline feeding garbage: an update
  of an honest size that points nowhere);
* ``bitflip`` — one random exponent bit (of the 8) flipped in a fraction of its fp32 values (the low-rank
  factors, or the dense values of a small tensor) before they are quantised: silent data corruption on the
  site's GPU. Flipping the top one multiplies a value below 2 by 2¹²⁸ (a pseudo-gradient's factor of 0.01
  becomes ~10³⁶): finite, but its square overflows fp32 (a flip that would make a value infinite is not
  made: the site's encoder refuses those, loudly);
* ``bitflip-low`` — the same with the 7 lower exponent bits only (× or ÷ 2, 4, 16, … 2⁶⁴): the values stay
  far from overflowing, the quiet end of the same fault;
* ``replay`` — the exact payload it pushed in the round before the fault, pushed again under every later
  round (a site stuck on an old update, or restored from the wrong checkpoint).

Evasions, faults made to stay under the check's bounds:

* ``underbound`` — its update × 9 every round, under the check's default 10× norm bound;
* ``drift`` — its update × 1.3 more each round (×1.3, ×1.69, …): the bound's reference, if the site could
  move it, would move along;
* ``halfsign`` — half its tensors negated (by name): its cosine with the others stays near 0 rather than −1.

Random draws are seeded by (seed, round, slice): a run is repeatable.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field

import torch

from dilocox.common.wire import codecs
from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.common.wire.lowrank import encode_lowrank, lowrank_factors

KINDS = ("scale", "sign", "noise", "bitflip", "bitflip-low", "replay", "underbound", "drift", "halfsign")
SCALE = 100.0
UNDER_BOUND = 9.0  # under the update check's default norm bound (10×)
DRIFT = 1.3  # per round of the fault
EXPONENT_BITS = {"bitflip": tuple(range(23, 31)), "bitflip-low": tuple(range(23, 30))}  # of an fp32: bits 23–30


def _values(item: EncodedSlice) -> list[torch.Tensor]:
    """The fp32 values the payload is made of: [Pᵀ, Qᵀ] for low rank, [the tensor] otherwise (copies)."""
    if item.codec == "lowrank":
        return [t.clone() for t in lowrank_factors(item.payload)]
    return [item.decode().clone()]


def _encoded(item: EncodedSlice, values: list[torch.Tensor]) -> EncodedSlice:
    """`values` (as `_values` gave them) encoded as `item` was: same codec, same factor quantiser."""
    if item.codec == "lowrank":
        p_t, q_t = values
        payload = encode_lowrank(
            p_t.T, q_t.T, item.payload[2]
        )  # header byte 2: the factors' bits (common/wire/lowrank.py)
    else:
        payload, _ = codecs.encode(item.codec, values[0])
    return EncodedSlice(item.key, item.codec, item.dtype, item.shape, bytearray(payload))


def _norm_sq(values: list[torch.Tensor], lowrank: bool) -> float:
    """‖update‖² of the slice: ‖P Qᵀ‖² = Σ (PᵀP) ∘ (QᵀQ) through the factors, never their product."""
    if lowrank:
        p_t, q_t = (v.double() for v in values)
        return float(((p_t @ p_t.T) * (q_t @ q_t.T)).sum())
    return float(values[0].double().square().sum())


def flip_exponent_bits(
    values: torch.Tensor, fraction: float, generator: torch.Generator, bits: tuple[int, ...] = EXPONENT_BITS["bitflip"]
) -> int:
    """Flip one random bit of `bits` in each value of `values` (fp32, in place) with probability
    `fraction`, each value on its own; returns how many were flipped."""
    flat = values.view(-1)
    where = (torch.rand(flat.numel(), generator=generator) < fraction).nonzero().view(-1)
    if not where.numel():
        return 0
    chosen = torch.tensor(bits)[torch.randint(len(bits), (where.numel(),), generator=generator)]
    flipped = (flat[where].view(torch.int32) ^ (1 << chosen).to(torch.int32)).view(torch.float32)
    # A value in [1, 2) with its top exponent bit set becomes Inf or NaN, which the site's own encoder
    # refuses (loud, not silent): that flip is not made.
    silent = torch.isfinite(flipped)
    flat[where[silent]] = flipped[silent]
    return int(silent.sum())


@dataclass
class SiteFault:
    """One site (`cluster`) faulty from round `from_round` on with `kind`; every other site's slices and
    its earlier rounds pass unchanged. Called from the client's push threads (one per shard)."""

    cluster: str
    kind: str
    from_round: int
    seed: int = 0
    bitflip_fraction: float = 1e-3
    flipped: int = 0  # values whose exponent bit was flipped, over the run (bitflip, bitflip-low)
    _before: dict[SliceKey, EncodedSlice] = field(default_factory=dict)  # replay: its last honest payload per slice
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose from {', '.join(KINDS)}")
        if self.kind == "replay" and self.from_round < 2:
            raise ValueError("a replay fault needs a round before it to replay: --fault-round ≥ 2")

    def __call__(self, cluster: str, round_: int, item: EncodedSlice) -> EncodedSlice:
        if cluster != self.cluster:
            return item
        if round_ < self.from_round:
            if self.kind == "replay":
                self._before[item.key] = item
            return item
        return self.corrupt(round_, item)

    def corrupt(self, round_: int, item: EncodedSlice) -> EncodedSlice:
        if self.kind == "replay":
            return self._before.get(item.key, item)
        key = item.key
        generator = torch.Generator().manual_seed(
            self.seed + zlib.crc32(f"{round_}:{key.name}:{key.row_start}:{key.row_stop}".encode())
        )
        values = _values(item)
        lowrank = item.codec == "lowrank"
        if self.kind == "scale":
            values[0].mul_(SCALE)  # P (or the tensor): the product scales with it
        elif self.kind == "sign":
            values[0].neg_()
        elif self.kind == "underbound":
            values[0].mul_(UNDER_BOUND)
        elif self.kind == "drift":
            values[0].mul_(DRIFT ** (round_ - self.from_round + 1))
        elif self.kind == "halfsign":
            if zlib.crc32(key.name.encode()) % 2:  # every slice of a tensor alike: the tensor negated whole
                values[0].neg_()
        elif self.kind == "noise":
            honest = _norm_sq(values, lowrank)
            values = [torch.randn(v.shape, generator=generator) for v in values]
            noise = _norm_sq(values, lowrank)
            values[0].mul_((honest / noise) ** 0.5 if noise > 0 else 0.0)
        else:  # bitflip, bitflip-low
            flipped = sum(
                flip_exponent_bits(v, self.bitflip_fraction, generator, EXPONENT_BITS[self.kind]) for v in values
            )
            with self._lock:
                self.flipped += flipped
        return _encoded(item, values)
