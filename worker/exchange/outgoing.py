"""The round boundary's arithmetic, done as θ arrives: Δ, the next start and the outgoing buffer in one pass.

A rank keeps two flat host buffers over the parameters it owns (`host_buffers.HostBuffers`): `start`
(s_t) and `outgoing`. With error feedback `outgoing` *is* the compressor's residual e between rounds
(`TensorCompressor.hold_residual`); at the boundary the pseudo-gradient is added into it, so it holds
what the round sends, Δ + e, which the background communicator compresses in place (leaving the new e).
Without error feedback it is where Δ is sent from. Either way no buffer of θ or Δ exists: the access
hands θ over in row pieces (`ParameterAccess.read_rows`), and for each piece, in chunks of at most
`CHUNK_ELEMENTS` through a small scratch d:

    d = s − θ                                   (Δ_t)
    s ← next start from d                       (delayed rounds: `delayed_start.next_start`)
    outgoing ← e + d  (μ_e·e + d with a decay;  d alone without error feedback)

— the very operations, per element and in the same order, that the boundary did over whole buffers
before (θ into a work buffer, Δ in place, the start from the replica minus the residual, the
compressor's e += Δ), so every bit is what it was. Host bytes per owned parameter: 4 + 4 here, 4 + 4 for
the replica and the outer momentum: 16 (docs/decisions.md, "The round boundary").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.compression import TensorCompressor
from dilocox.common.wire.finite import all_finite
from dilocox.common.wire.framing import SliceKey
from dilocox.common.wire.outer_optimizer import OuterNesterov
from dilocox.worker.exchange.delayed_start import next_start
from dilocox.worker.exchange.host_buffers import HostBuffers

CHUNK_ELEMENTS = 2**20  # the scratch d: 4 MB


@dataclass(frozen=True)
class NextStart:
    """How a delayed round's successor starts: from the replica (`from_held`: θ_{t-1} travelled back),
    less the residual where error feedback keeps it in the weights, else from s_t itself; by `rule`."""

    rule: str
    from_held: bool
    share: float


class OutgoingFold:
    """Folds θ, piece by piece, into `start` and `outgoing` (the module's docstring)."""

    def __init__(self, buffers: HostBuffers, slices: list[ParamSlice], compressor: TensorCompressor | None) -> None:
        self.buffers = buffers
        self.by_name: dict[str, list[ParamSlice]] = {}
        for s in slices:
            self.by_name.setdefault(s.name, []).append(s)
        self.compressor = compressor
        config = compressor.config if compressor is not None else None
        self.feedback = bool(config and config.error_feedback)
        self.decay = config.error_decay if config is not None else 1.0
        self.local_residual = bool(compressor is not None and compressor.keeps_local_residual)
        self._scratch = torch.empty(0)
        self.own_momentum: dict[SliceKey, torch.Tensor] = {}  # W per slice, for the `eager` start only
        if self.feedback:
            assert compressor is not None
            for s in slices:  # the residual lives in `outgoing` from now on (a restored one is copied in)
                compressor.hold_residual(s.key, s.view(buffers.outgoing[s.name]))

    def outgoing_slices(self) -> dict[SliceKey, torch.Tensor]:
        return {s.key: s.view(self.buffers.outgoing[s.name]) for group in self.by_name.values() for s in group}

    def rebase(self, held: dict[SliceKey, torch.Tensor]) -> Rebase:
        """A `land` for `read_rows` at a mid-round merge (`Rebase`)."""
        return Rebase(self, held)

    def fold(self, held: dict[SliceKey, torch.Tensor], start: NextStart | None, outer: OuterNesterov | None) -> Folding:
        """A `land` for `read_rows`: Δ into `outgoing`, and with `start` (a delayed round) the next start
        into `start` from the replica `held` and the outer momentum in `outer`."""
        return Folding(self, held, start, outer)

    def scratch(self, n: int) -> torch.Tensor:
        if self._scratch.numel() < n:
            self._scratch = torch.empty(max(n, min(CHUNK_ELEMENTS, 1 << 16)))
        return self._scratch[:n]


class RowWalk:
    """Hands each piece of θ that `read_rows` lands to `_chunk`, cut at the owner's slices and in chunks of
    at most `CHUNK_ELEMENTS`, with the matching chunks of the two buffers."""

    owner: OutgoingFold

    def __call__(self, name: str, first: int, last: int, theta: torch.Tensor) -> None:
        buffers = self.owner.buffers
        start_flat = buffers.start[name].reshape(-1)
        outgoing_flat = buffers.outgoing[name].reshape(-1)
        for s in self.owner.by_name.get(name, []):
            lo, hi = max(first, s.row_start), min(last, s.row_stop)
            if lo >= hi:
                continue
            width = s.row_numel
            # element ranges: in the parameter, in the piece handed over, in the slice's own tensors
            at, n = lo * width, (hi - lo) * width
            in_piece, in_slice = (lo - first) * width, (lo - s.row_start) * width
            for c in range(0, n, CHUNK_ELEMENTS):
                m = min(CHUNK_ELEMENTS, n - c)
                self._chunk(
                    s.key,
                    start_flat[at + c : at + c + m],
                    outgoing_flat[at + c : at + c + m],
                    theta[in_piece + c : in_piece + c + m],
                    in_slice + c,
                    m,
                )

    def _chunk(
        self, key: SliceKey, s: torch.Tensor, out: torch.Tensor, theta: torch.Tensor, offset: int, m: int
    ) -> None:
        raise NotImplementedError


class Rebase(RowWalk):
    """A mid-round merge (`overlap_steps`): the merged model θ_t arrived τ steps into round t+1, whose
    start s holds the model as round t ended. Each piece of the live model x becomes x + (θ_t − e) − s —
    the merged model with the τ steps' own progress on top, as the boundary's `own` rule keeps a round's
    — written into `start`, from which the caller writes the model and then sets the start to θ_t − e."""

    def __init__(self, owner: OutgoingFold, held: dict[SliceKey, torch.Tensor]) -> None:
        self.owner, self.held = owner, held

    def _chunk(
        self, key: SliceKey, s: torch.Tensor, out: torch.Tensor, theta: torch.Tensor, offset: int, m: int
    ) -> None:
        owner = self.owner
        held = self.held[key].reshape(-1)[offset : offset + m]
        s.neg_().add_(theta).add_(held)  # x − s + θ_t
        if owner.local_residual:
            s.sub_(owner.compressor.residual(key).reshape(-1)[offset : offset + m])  # type: ignore[union-attr]


class Folding(RowWalk):
    """One boundary's fold; `nonfinite` names a slice whose Δ held NaN or Inf (its chunk left unfolded)."""

    def __init__(
        self,
        owner: OutgoingFold,
        held: dict[SliceKey, torch.Tensor],
        start: NextStart | None,
        outer: OuterNesterov | None,
    ) -> None:
        self.owner, self.held, self.start, self.outer = owner, held, start, outer
        self.nonfinite: SliceKey | None = None

    def _chunk(
        self, key: SliceKey, s: torch.Tensor, out: torch.Tensor, theta: torch.Tensor, offset: int, m: int
    ) -> None:
        owner = self.owner
        d = owner.scratch(m)
        torch.sub(s, theta, out=d)  # Δ = s − θ
        if not all_finite(d):  # the residual and the start stay as they were; the boundary refuses the round
            self.nonfinite = self.nonfinite or key
            return
        if self.start is not None:
            self._next_start(key, s, d, offset, m)
        if not owner.feedback:
            out.copy_(d)
            return
        if owner.decay != 1:
            out.mul_(owner.decay)
        out.add_(d)  # e + Δ: the compressor's own addition

    def _next_start(self, key: SliceKey, s: torch.Tensor, d: torch.Tensor, offset: int, m: int) -> None:
        rule = self.start
        assert rule is not None
        if rule.from_held:  # θ_{t-1}, less the residual where error feedback keeps it in the weights
            held = self.held[key].reshape(-1)[offset : offset + m]
            if self.owner.local_residual:
                residual = self.owner.compressor.residual(key)  # type: ignore[union-attr]
                torch.sub(held, residual.reshape(-1)[offset : offset + m], out=s)
            else:
                s.copy_(held)
        momentum = self.outer.buffers.get(key) if self.outer is not None else None
        momentum = momentum.reshape(-1)[offset : offset + m] if momentum is not None else None
        own = None
        if rule.rule == "eager":  # W is made once per slice, not a fresh zero tensor per chunk
            momenta = self.owner.own_momentum
            if key not in momenta:
                momenta[key] = torch.zeros(self.held[key].numel())
            own = momenta[key][offset : offset + m]
        next_start(rule.rule, s, s, d, momentum, self.outer, rule.share, own)
