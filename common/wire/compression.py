"""Adaptive pseudo-gradient compression with error feedback (DESIGN.md §3, "Adaptive compression").

`TensorCompressor` holds the per-tensor state that makes compression work across rounds:

* **error feedback** — what compression dropped last round is added back before compressing this one:
  send C(Δ + e), keep e ← Δ + e − D(C(Δ + e)); nothing is lost for good, only delayed;
* **warm start** — the previous round's Q seeds this round's single power iteration (PowerSGD);
* **adaptive rank** — the energy each component captures (from the singular values of the factor
  pair) picks the smallest rank reaching `target_energy`, clamped to [rank_min, rank_max] and smoothed
  over a window of rounds; every change is logged with its reason.

2-D tensors (N-d viewed as first dim × rest) with at least `min_lowrank_numel` elements go low-rank;
everything else is only quantised. The codecs themselves are the pure functions of `common.codecs`,
`common.quantize` and `common.lowrank`; the shard decodes from the bytes alone.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import structlog
import torch

from dilocox.common.wire import codecs
from dilocox.common.wire.finite import all_finite
from dilocox.common.wire.lowrank import (
    OrderedProduct,
    as_matrix_shape,
    encode_lowrank,
    lowrank_factors,
    ordered_factors,
    power_iteration,
)

log = structlog.get_logger()

CODEC_CHOICES = ("fp32", "fp16", "bf16", "int8", "int4", "lowrank")
FLUSH_CODEC_CHOICES = ("none", "fp32", "fp16", "bf16", "int8", "int4")


@dataclass(frozen=True)
class CompressionConfig:
    """How pseudo-gradients (uplink) and weight changes (downlink) are compressed."""

    codec: str = "lowrank"  # fp32 | fp16 | bf16 | int8 | int4 | lowrank
    factor_bits: int = 4  # quantiser of low-rank factors and of small/1-D tensors in lowrank mode (4, 8, 32)
    rank_min: int = 1
    # ≤ 8 components with error feedback kept locally: 103× / 103× below dense fp32 (up / down) with the
    # delay, at a lower loss than the earlier ≤ 24 / 95% without error feedback at 40× (docs/performance.md,
    # `dilocox bench compression`; rank_max 6 is the lean preset, ≈ 128×). With error feedback the
    # residual flattens the spectrum, so the rank mostly sits at rank_max.
    rank_max: int = 8
    target_energy: float = 0.5  # smallest rank whose components capture this share of ‖Δ + e‖²
    rank_window: int = 3  # rounds over which the chosen rank is smoothed (max of the window)
    adaptive_rank: bool = True  # False: always rank_max
    min_lowrank_numel: int = 4096  # smaller matrices are only quantised
    # On by default, with the residual kept in the cluster's weights (local_residual): without error
    # feedback the dropped part of every round is lost for good (+14.8% loss at rank ≤ 8, docs/performance.md).
    error_feedback: bool = True
    error_decay: float = 1.0  # share of last round's residual carried into this one (1 = classic error feedback)
    # With error feedback, the cluster also keeps its unsent residual in its own weights: it trains on
    # from the global model minus what it has not delivered yet, so that it neither re-learns nor
    # re-sends that part (classic error feedback does both; docs/decisions.md).
    local_residual: bool = True
    # After the last round each cluster sends what error feedback (kept locally) still holds back, once,
    # with this dense quantiser (the residual is what low rank could not carry, so it has no low-rank
    # structure), and the run ends on a global model that holds all the clusters' progress. Without it
    # the last residuals never reach the shards: +6.0% instead of +3.6% loss with the delay, for a
    # one-off ≈ 12 rounds' worth of bytes (docs/decisions.md). "none": end on the last round's model.
    flush_codec: str = "int4"

    @property
    def flushes_residuals(self) -> bool:
        """Whether a compressing run ends with a flush of the residuals: only where the residual is
        progress the cluster holds and the shards lack (`local_residual`). With classic error feedback the
        cluster has partly re-learned it already, and flushing it counted twice (+17.5% → +21.9% loss)."""
        return self.error_feedback and self.local_residual and self.flush_codec != "none"

    def __post_init__(self) -> None:
        if self.codec not in CODEC_CHOICES:
            raise ValueError(f"codec must be one of {CODEC_CHOICES}, got {self.codec!r}")
        if self.factor_bits not in (4, 8, 32):
            raise ValueError(f"factor_bits must be 4, 8 or 32, got {self.factor_bits}")
        if not 1 <= self.rank_min <= self.rank_max:
            raise ValueError(f"need 1 ≤ rank_min ≤ rank_max, got {self.rank_min}, {self.rank_max}")
        if not 0 <= self.error_decay <= 1:
            raise ValueError(f"error_decay must be in [0, 1], got {self.error_decay}")
        if self.error_feedback and self.local_residual and self.error_decay != 1:
            raise ValueError(
                f"local_residual keeps the whole unsent residual in the cluster's weights, so it needs "
                f"error_decay = 1 (got {self.error_decay}); set local_residual false to decay the residual"
            )
        if not 0 < self.target_energy <= 1:
            raise ValueError(f"target_energy must be in (0, 1], got {self.target_energy}")
        if self.flush_codec not in FLUSH_CODEC_CHOICES:
            raise ValueError(f"flush_codec must be one of {FLUSH_CODEC_CHOICES}, got {self.flush_codec!r}")

    @property
    def small_tensor_codec(self) -> str:
        return {4: "int4", 8: "int8", 32: "fp32"}[self.factor_bits]


@dataclass
class Encoded:
    """One compressed tensor: the bytes to frame, and (`decoded`) what the receiver will reconstruct
    from them — decoded when first asked for: a compressor without error feedback never needs it, and a
    low-rank decode is a dense tensor and most of a push's time."""

    codec: str
    dtype: str
    payload: bytes | memoryview
    shape: tuple[int, ...]
    rank: int | None = None
    _decoded: torch.Tensor | None = field(default=None, repr=False)

    @property
    def decoded(self) -> torch.Tensor:
        if self._decoded is None:
            self._decoded = codecs.decode(self.codec, bytearray(self.payload), self.dtype, self.shape)
        return self._decoded


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


@dataclass
class _TensorState:
    error: torch.Tensor | None = None
    q: torch.Tensor | None = None
    rank: int = 0
    recent_ranks: deque = field(default_factory=deque)


class TensorCompressor:
    """Compresses a stream of same-shaped tensors per key, keeping error-feedback and rank state."""

    def __init__(
        self, config: CompressionConfig, seed: int = 0, name: str = "uplink", track_deficit: bool = False
    ) -> None:
        """`track_deficit`: also keep Σ inputs − Σ decoded per key (one more model-sized buffer), the
        signal compression has withheld so far; benchmarks read it to show what error feedback does."""
        self.config = config
        self.seed = seed
        self.name = name
        self.state: dict[Hashable, _TensorState] = {}
        self.deficit: dict[Hashable, torch.Tensor] | None = {} if track_deficit else None
        self.input_sum: dict[Hashable, torch.Tensor] = {}
        self._settled: dict[Hashable, torch.Tensor] = {}  # with track_deficit: each residual after its last message

    def uses_lowrank(self, shape: tuple[int, ...]) -> bool:
        return self.config.codec == "lowrank" and len(shape) >= 2 and math.prod(shape) >= self.config.min_lowrank_numel

    @property
    def flushes(self) -> bool:
        """Whether the run ends with a flush of the residuals (`CompressionConfig.flushes_residuals`)."""
        return self.config.flushes_residuals

    def hold_residual(self, key: Hashable, buffer: torch.Tensor) -> None:
        """Keep `key`'s error-feedback residual in `buffer` (a view into the caller's memory, same shape
        as the tensors compressed under `key`), taking over what the residual held (a restored one), else
        zeros. The caller then forms Δ + e there itself and compresses it with `compress_formed`: the
        round boundary adds Δ into the residual while it reads θ, so no buffer of Δ exists
        (worker/exchange/outgoing.py)."""
        state = self.state.setdefault(key, _TensorState())
        if state.error is None:
            buffer.zero_()
        elif not _same_memory(state.error, buffer):
            buffer.copy_(state.error.reshape(buffer.shape))
        state.error = buffer

    def compress_formed(self, key: Hashable, target: torch.Tensor, codec: str | None = None) -> Encoded:
        """C(target), where `target` is Δ + e already formed in the residual's own buffer (`hold_residual`)
        — or, without error feedback, Δ alone; with error feedback what the payload delivers is subtracted
        there, leaving the new residual. A failure to encode leaves `target` as it was given."""
        state = self.state.setdefault(key, _TensorState())
        feedback = self.config.error_feedback
        if feedback and (state.error is None or not _same_memory(state.error, target)):
            raise ValueError(f"{key}: compress_formed needs the tensor its residual is held in (hold_residual)")
        given = None
        if self.deficit is not None:  # Δ itself, from the residual this compressor left last time (benchmarks)
            settled = self._settled.get(key) if feedback else None
            given = target.clone() if settled is None else target - self.config.error_decay * settled
        encoded = self._encode(key, state, target, codec)
        if feedback:
            if isinstance(encoded.payload, memoryview):  # fp32 payloads view their tensor: the residual's buffer
                encoded.payload = bytes(encoded.payload)
            self._subtract_delivered(target, encoded)
        if given is not None:
            if feedback:
                self._settled[key] = target.clone()
            self._track_deficit(key, given, encoded)
        return encoded

    def compress(self, key: Hashable, delta: torch.Tensor, codec: str | None = None) -> Encoded:
        """C(Δ + e) with the configured codec, or with the dense `codec` given for this one message
        (the end-of-run flush: compress a zero Δ and error feedback sends exactly the residual).

        With error feedback, Δ + e is formed in the residual's own buffer and what the payload delivers
        is subtracted from it there, block by block (`OrderedProduct.subtract_from` for low rank): the same
        bits as `e ← (Δ + e) − D(C(Δ + e))` without a model-sized temporary. The residual is settled
        when this returns (a checkpoint or a local start reads it between rounds, never during one)."""
        state = self.state.setdefault(key, _TensorState())
        given = delta.detach().to(torch.float32)
        feedback = self.config.error_feedback
        in_place = feedback and state.error is not None and self.config.error_decay == 1
        if in_place:
            if not all_finite(given):  # before the residual is touched: a refused Δ leaves it as it was
                raise ValueError(f"pseudo-gradient of {key} holds NaN or Inf")
            target = state.error.add_(given.reshape(state.error.shape))
        elif feedback and state.error is not None:
            target = given + self.config.error_decay * state.error
        else:
            target = given.clone() if feedback else given
        try:
            encoded = self._encode(key, state, target, codec)
        except Exception:
            if in_place:  # the residual as it was, to within rounding
                target.sub_(given.reshape(target.shape))
            raise
        if feedback:
            if isinstance(encoded.payload, memoryview):  # fp32 payloads view their tensor: the residual's buffer
                encoded.payload = bytes(encoded.payload)
            self._subtract_delivered(target, encoded)
            state.error = target
        if self.deficit is not None:
            self._track_deficit(key, given, encoded)
        return encoded

    def _track_deficit(self, key: Hashable, given: torch.Tensor, encoded: Encoded) -> None:
        assert self.deficit is not None
        self.input_sum[key] = self.input_sum[key] + given if key in self.input_sum else given.clone()
        withheld = given - encoded.decoded.reshape(given.shape)
        self.deficit[key] = self.deficit[key] + withheld if key in self.deficit else withheld

    def _encode(self, key: Hashable, state: _TensorState, target: torch.Tensor, codec: str | None) -> Encoded:
        if codec is not None:
            return self._stateless(codec, target)
        if self.config.codec != "lowrank":
            return self._stateless(self.config.codec, target)
        if self.uses_lowrank(tuple(target.shape)):
            return self._lowrank(key, state, target)
        return self._stateless(self.config.small_tensor_codec, target)

    @staticmethod
    def _subtract_delivered(target: torch.Tensor, encoded: Encoded) -> None:
        """target −= what the receiver decodes from `encoded`, with the receiver's bits."""
        if encoded.codec == "lowrank":
            OrderedProduct(*lowrank_factors(encoded.payload)).subtract_from(target)
        else:
            target.sub_(encoded.decoded.reshape(target.shape))

    def state_dict(self) -> dict:
        """Error-feedback residuals, warm-start Q and rank history per key (for a worker checkpoint)."""
        return {
            key: {"error": st.error, "q": st.q, "rank": st.rank, "recent_ranks": list(st.recent_ranks)}
            for key, st in self.state.items()
        }

    def load_state_dict(self, state: dict) -> None:
        self.state = {
            key: _TensorState(v["error"], v["q"], v["rank"], deque(v["recent_ranks"])) for key, v in state.items()
        }

    @property
    def keeps_local_residual(self) -> bool:
        """Whether the cluster should keep the unsent residual in its weights (see CompressionConfig)."""
        return self.config.error_feedback and self.config.local_residual

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """What `key`'s compressed messages have not delivered yet (Σ inputs − Σ decoded, with error
        feedback at decay 1); None before its first round or without error feedback."""
        state = self.state.get(key)
        return state.error if state is not None else None

    def residual_norm(self) -> float:
        """‖e‖ over all tensors: how much error feedback is carrying (should stay bounded)."""
        states = list(self.state.values())  # with the delay the background sender may add keys meanwhile
        return math.sqrt(sum(float(s.error.square().sum()) for s in states if s.error is not None))

    def mean_rank(self) -> float:
        """Mean rank of the low-rank tensors' latest messages (0.0 before any, or with no low-rank tensor):
        where the adaptive rank has settled between rank_min and rank_max, for run tracking."""
        ranks = [s.rank for s in list(self.state.values()) if s.rank > 0]  # the background sender may add keys
        return sum(ranks) / len(ranks) if ranks else 0.0

    def deficit_norm(self) -> float:
        """‖Σ inputs − Σ decoded‖ over all tensors (needs `track_deficit`): bounded by the residual with
        error feedback (decay 1), growing with the rounds without it."""
        if self.deficit is None:
            raise RuntimeError("this compressor was created without track_deficit")
        return math.sqrt(
            sum(float(d.square().sum()) for d in list(self.deficit.values()))
        )  # another thread may add keys

    def relative_deficit(self) -> float:
        """`deficit_norm` over ‖Σ inputs‖: the share of all signal so far that has not reached the receiver."""
        total = math.sqrt(sum(float(t.square().sum()) for t in list(self.input_sum.values())))
        return self.deficit_norm() / max(total, 1e-30)

    # ------------------------------------------------------------------ codecs
    @staticmethod
    def _stateless(codec: str, tensor: torch.Tensor) -> Encoded:
        payload, dtype = codecs.encode(codec, tensor)
        return Encoded(codec, dtype, payload, tuple(tensor.shape))

    def _lowrank(self, key: Hashable, state: _TensorState, target: torch.Tensor) -> Encoded:
        cfg = self.config
        rows, cols = as_matrix_shape(tuple(target.shape))
        matrix = target.reshape(rows, cols)
        width = min(cfg.rank_max, rows, cols)
        if state.q is None or state.q.shape != (cols, width):
            g = torch.Generator().manual_seed(self.seed + zlib.crc32(str(key).encode()))  # same in every process
            state.q = torch.randn(cols, width, generator=g)
        p, q = power_iteration(matrix, state.q)
        state.q = q / q.norm(dim=0).clamp_min(1e-30)  # warm start for next round (scale-free)
        p, q, singular = ordered_factors(p, q)
        flat = matrix.reshape(-1)
        rank = state.rank = self._choose_rank(key, state, singular, float(torch.dot(flat, flat)), width)
        p, q = p[:, :rank].contiguous(), q[:, :rank].contiguous()
        return Encoded("lowrank", "float32", encode_lowrank(p, q, cfg.factor_bits), tuple(target.shape), rank)

    def _choose_rank(
        self, key: Hashable, state: _TensorState, singular: torch.Tensor, total_energy: float, width: int
    ) -> int:
        cfg = self.config
        if not cfg.adaptive_rank:
            return width
        energy = singular.square()
        captured = torch.cumsum(energy, 0) / max(total_energy, 1e-30)
        reaching = (captured >= cfg.target_energy).nonzero()
        wanted = int(reaching[0]) + 1 if len(reaching) else width
        # rank_min first, then the width: a matrix narrower than rank_min cannot carry rank_min columns
        wanted = min(width, max(cfg.rank_min, wanted))
        state.recent_ranks.append(wanted)
        while len(state.recent_ranks) > cfg.rank_window:
            state.recent_ranks.popleft()
        rank = max(state.recent_ranks)
        if rank != state.rank:
            share = float(captured[wanted - 1])
            verdict = "captures ≥" if share >= cfg.target_energy else "falls short of "
            log.info(
                "rank_adapted",
                compressor=self.name,
                tensor=str(key),
                rank=rank,
                previous=state.rank or None,
                reason=f"rank {wanted} {verdict}{cfg.target_energy:.0%} of the energy "
                f"({share:.1%}); window max of {list(state.recent_ranks)}",
            )
            state.rank = rank
        return rank
