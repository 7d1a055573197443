"""What a shard hands out and keeps about its rounds: the results of a join and a push, a published
version (`Snapshot`), how the last round closed (`RoundStats`), and a round sealed for its close
(`SealedRound`). Plain records: the rules that fill them are `server/shard.py` and `server/rounds/shard_close.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dilocox.common.wire.assignment import ParamSlice
from dilocox.common.wire.framing import SliceKey
from dilocox.server.rounds.round_close import CloseDecision
from dilocox.server.rounds.round_state import Contribution, RoundAccumulator


@dataclass
class JoinResult:
    cluster: str
    version: int
    needs_init: bool
    assignment: list[ParamSlice]
    run_config_json: str
    rejoin: bool = False
    tokenizer_digest: str = ""
    tokenizer_json: str = ""  # filled for observers (export) only


@dataclass
class PushResult:
    round: int
    accepted: int
    duplicate: int
    round_closed: bool


@dataclass
class Snapshot:
    """One published version: θ_v, the outer momentum after it, and the contributions that made it.

    Nothing here is modified while a pull holds it (`Shard.wait_for_version(hold=True)`), so a pull
    streaming version v is never torn by the close of round v+1; a close with no such pull updates the
    weights and momentum in place, so a shard needs one copy of them, not two. `contributions` is what
    a cluster holding version v−1 needs to replay the step itself — the compressed downlink.
    """

    version: int
    tensors: dict[SliceKey, torch.Tensor]
    momentum: dict[SliceKey, torch.Tensor] = field(default_factory=dict)
    contributions: dict[SliceKey, dict[str, Contribution]] = field(default_factory=dict)
    digests: dict[tuple[str, SliceKey], bytes] = field(
        default_factory=dict
    )  # (function, slice) -> state digest, filled on first ask


@dataclass(frozen=True)
class RoundStats:
    """How the last round closed, kept for metrics (`on_publish` reads it) and `dilocox status`."""

    round: int
    clusters: tuple[str, ...]  # whose contributions made it
    dropped: tuple[str, ...]  # marked inactive at this close (missed the deadline)
    update_s: float  # decoding the contributions, their mean and the outer step (one fused pass)
    latency_s: float  # first contribution in → version published
    closed_at: float  # wall clock (time.time())
    late: tuple[str, ...] = ()  # members it closed without (quorum + grace): their part comes next round
    tokens: tuple[tuple[str, float], ...] = ()  # (cluster, weight) of those who made it
    grace_s: float | None = None  # the grace window it was given (quorum + grace only)
    excluded: tuple[str, ...] = ()  # complete, but left out by the update check (server/checks/update_check.py)


@dataclass(frozen=True)
class SealedRound:
    """A round sealed for its close: its contributions, who is in, the version it steps from."""

    acc: RoundAccumulator
    decision: CloseDecision
    snapshot: Snapshot
    in_place: bool
