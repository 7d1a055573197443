"""Each site's update is looked at before the shard merges it: its size, its direction, whether it is new.

Why: the sites of a run belong to different organisations, and each is a place where things go wrong — a
GPU with silent data corruption, a fork with a bug, a data pipeline feeding garbage, a site restored from
the wrong checkpoint. Without a check, whatever a joined site pushes is averaged into every site's model.

What a shard computes per round, on the slices it owns, from the payloads as they came (a low-rank
payload through its factors, never its product; server/round_figures.py): what it needs of the Gram matrix G
of the sites' updates (G_ij = ⟨Δ_i, Δ_j⟩, summed over slices) and each update's inner product with the
previous round's global update, from the contributions the shard keeps for replay. From them, per site:

* `norm_ratio` — ‖Δ_i‖ over the reference norm: the median of the norms this shard accepted over the last
  `history` rounds (or, before any, this round's median where three or more sites pushed);
* `cosine_others` — cos(Δ_i, the weighted mean of the other sites' updates, each as a unit vector and the
  outsized ones left out, so one huge update cannot drown the others' direction), with three or more sites
  (with two, neither is a majority: the check then has only the norm, the previous update and the replay);
* `cosine_previous` — cos(Δ_i, the previous round's global update: the weighted mean of the contributions
  it merged), from the second round on. (Not the outer momentum: against a dense buffer a low-rank
  update costs rows × cols × rank per site, as much as the step's own decode.)
* `replayed` — its whole contribution here (every payload, byte for byte) equal to one this shard received
  in the last `history` rounds, from any site (an old round's update pushed again); a zero update is not
  counted (it carries nothing to replay).

A site is flagged when its figures are not finite (an update so large that its squared norm exceeds fp32's range), its norm
ratio exceeds `norm_ratio`, a cosine is below `min_cosine`, or it replayed;
flagged `quarantine_rounds` rounds in a row it is quarantined: under `exclude` and `clip` left out of every
round, passing or not, until it passes `quarantine_rounds` rounds in a row (its statistics are still
computed) or an operator readmits it (`dilocox readmit`). One clean round is not enough: a faulty site that
passes now and then — noise of an honest update's size is flagged in about half its rounds — would slip a
faulty update into every round it happens to pass. `mode`: `off`; `warn` (log, count, merge anyway: the default);
`exclude` (a flagged or quarantined site's contributions are left out of the round, so its version and
the contributions every site replays from are made without them — the clients' replay stays bit-exact
because what is left out is simply not forwarded); `clip` (an update whose only flag is its size is
merged scaled down to the reference norm, c·Δ with c = reference / ‖Δ‖, at its full weight — the
honest sites' mean is neither inflated by it nor diluted; any other flag leaves the update out, as
`exclude` does, and so does quarantine. The factor travels with the forwarded contribution (proto
`scale`), so every replay computes the same c·w). Each shard decides on its own slices; a site faulty on all of its update is
flagged by every shard alike.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from dilocox.server.round_figures import RoundFigures

MODES = ("off", "warn", "clip", "exclude")
# A site whose ‖Δ‖² exceeds fp32's range is flagged `non_finite`: the figures are formed in float64, where
# it would not overflow, but an update that large is a fault (a flipped exponent bit), not a big step.
FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class UpdateCheckConfig:
    mode: str = "warn"
    norm_ratio: float = 10.0  # flag ‖Δ‖ above this many times the reference norm
    min_cosine: float = 0.0  # flag an update pointing away from the others' mean or the previous update
    quarantine_rounds: int = 2  # flagged this many rounds in a row: left out until it passes this many in a row
    history: int = 8  # rounds of accepted norms and of payload digests kept

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--update-check must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.norm_ratio > 1:
            raise ValueError(f"--update-check-norm-ratio must be > 1, got {self.norm_ratio}")
        if not -1 <= self.min_cosine < 1:
            raise ValueError(f"--update-check-min-cosine must be in [-1, 1), got {self.min_cosine}")
        if self.quarantine_rounds < 1 or self.history < 1:
            raise ValueError("--update-check-quarantine-rounds and the history must be ≥ 1")


@dataclass(frozen=True)
class SiteVerdict:
    """One site's figures in one round and what the check made of them."""

    cluster: str
    norm: float
    norm_ratio: float | None
    cosine_others: float | None
    cosine_previous: float | None
    replayed: bool
    reasons: tuple[str, ...]  # why flagged: non_finite, outsized, disagrees, against_previous, replayed
    quarantined: bool  # flagged quarantine_rounds rounds in a row, and not yet passed as many (or readmitted)
    excluded: bool  # left out of the round (mode exclude, or clip for a flag other than size)
    scale: float = 1.0  # mode clip: merged as scale·Δ (< 1: clipped to the reference norm)

    def record(self) -> dict:
        """What the rounds chain keeps of it (server/provenance_chain.py): the figures and the outcome."""
        return {**self.figures(), "replayed": self.replayed, "reasons": list(self.reasons), "quarantined": self.quarantined,
                "excluded": self.excluded, **({"scale": self.scale} if self.scale != 1.0 else {})}  # fmt: skip

    def figures(self) -> dict:
        rounded = lambda x: None if x is None else round(x, 4) if math.isfinite(x) else str(x)  # noqa: E731 - JSON has no inf
        return {"norm": rounded(self.norm), "norm_ratio": rounded(self.norm_ratio), "cosine_others": rounded(self.cosine_others),
                "cosine_previous": rounded(self.cosine_previous)}  # fmt: skip


def _cosine(dot: float, a_sq: float, b_sq: float) -> float | None:
    return dot / (a_sq * b_sq) ** 0.5 if a_sq > 0 and b_sq > 0 else None


class UpdateCheck:
    """The check's memory across rounds (accepted norms, payload digests, flag streaks) and its verdicts."""

    def __init__(self, config: UpdateCheckConfig | None = None) -> None:
        self.config = config or UpdateCheckConfig()
        self._norms: deque[list[float]] = deque(maxlen=self.config.history)
        self._digests: deque[set[bytes]] = deque(maxlen=self.config.history)
        self.streak: dict[str, int] = {}  # cluster -> rounds flagged in a row
        self.passed: dict[str, int] = {}  # quarantined cluster -> rounds passed in a row since
        self.quarantined: set[str] = set()
        self.last_flagged: frozenset[str] = frozenset()  # flagged in the last round reviewed: not a reference

    def review(self, figures: RoundFigures, weights: Mapping[str, float]) -> list[SiteVerdict]:
        cfg, clusters = self.config, figures.clusters
        # A site whose own figures overflow (an exponent flipped to huge values) is flagged as such and
        # left out of every other site's figures, which would otherwise turn NaN and pass unflagged.
        sq = figures.sq_norms.clone()
        bad = {i for i in range(len(clusters)) if not float(sq[i]) <= FP32_MAX}  # NaN too
        for i in bad:
            sq[i] = 0.0
        norms = [math.inf if i in bad else max(0.0, float(sq[i])) ** 0.5 for i in range(len(clusters))]
        finite = [x for x in norms if math.isfinite(x)]
        history = [x for accepted in self._norms for x in accepted]
        reference = statistics.median(history) if history else statistics.median(finite) if len(finite) >= 3 else None
        seen = set().union(*self._digests) if self._digests else set()
        ratios = [norms[i] / reference if reference else None for i in range(len(clusters))]
        # The others' direction: each site's update as a unit vector (by its weight), outsized or overflowing
        # ones left out, so that one huge update cannot make every honest one look orthogonal to "the others".
        suspect = bad | {i for i, r in enumerate(ratios) if r is not None and r > cfg.norm_ratio}
        w = torch.tensor([0.0 if i in suspect or norms[i] == 0 else float(weights.get(c, 1.0)) / norms[i]
                          for i, c in enumerate(clusters)], dtype=torch.float64)  # fmt: skip
        gw, wgw = figures.weighted(w) if len(clusters) >= 3 else (None, 0.0)
        weighted_sites = int((w != 0).sum())
        verdicts = []
        for i, cluster in enumerate(clusters):
            ratio = ratios[i]
            cos_others = None
            if gw is not None and weighted_sites - int(w[i] != 0) > 0:  # others = w less site i: its own term taken back out
                own, g_ii, gw_i = float(w[i]), float(sq[i]), float(gw[i])
                dot, rest = (gw_i - own * g_ii, wgw - 2 * own * gw_i + own * own * g_ii) if own else (gw_i, wgw)
                cos_others = _cosine(dot, g_ii, rest)
            # None where the previous update's own figures overflow fp32 (a faulty one merged: warn mode)
            cos_prev = None if i in bad or not figures.previous_sq <= FP32_MAX else _cosine(float(figures.with_previous[i]), float(sq[i]), figures.previous_sq)
            if cos_prev is not None and not math.isfinite(cos_prev):
                cos_prev = None
            replayed = norms[i] > 0 and figures.contribution_digests.get(cluster) in seen
            reasons = tuple(r for r, hit in (("non_finite", i in bad),
                                             ("outsized", ratio is not None and ratio > cfg.norm_ratio),
                                             ("disagrees", cos_others is not None and cos_others < cfg.min_cosine),
                                             ("against_previous", cos_prev is not None and cos_prev < cfg.min_cosine),
                                             ("replayed", replayed)) if hit)  # fmt: skip
            self._count(cluster, bool(reasons))
            scale = 1.0
            if cfg.mode == "clip" and reasons == ("outsized",) and cluster not in self.quarantined:
                scale = reference / norms[i]  # ratio > norm_ratio > 1: reference is set and norms[i] > it
                excluded = False
            else:
                excluded = cfg.mode in ("exclude", "clip") and (bool(reasons) or cluster in self.quarantined)
            verdicts.append(SiteVerdict(cluster, norms[i], ratio, cos_others, cos_prev, replayed, reasons, cluster in self.quarantined,
                                        excluded, scale))  # fmt: skip
        accepted = [v.norm for v in verdicts if not v.reasons]
        if accepted:
            self._norms.append(accepted)
        self._digests.append(set(figures.contribution_digests.values()))
        self.last_flagged = frozenset(v.cluster for v in verdicts if v.reasons)
        return verdicts

    def as_state(self) -> dict:
        """What a shard checkpoint keeps (a restarted shard must not forget a quarantine): small."""
        return {"norms": [list(n) for n in self._norms], "digests": [sorted(d) for d in self._digests], "streak": dict(self.streak),
                "passed": dict(self.passed), "quarantined": sorted(self.quarantined), "last_flagged": sorted(self.last_flagged)}  # fmt: skip

    def load_state(self, state: dict) -> None:
        self._norms.extend(list(n) for n in state.get("norms", []))
        self._digests.extend(set(d) for d in state.get("digests", []))
        self.streak, self.passed = dict(state.get("streak", {})), dict(state.get("passed", {}))
        self.quarantined, self.last_flagged = set(state.get("quarantined", [])), frozenset(state.get("last_flagged", []))

    def _count(self, cluster: str, flagged: bool) -> None:
        """Streaks: flagged `quarantine_rounds` in a row quarantines; passed as many in a row since, released."""
        k = self.config.quarantine_rounds
        self.streak[cluster] = self.streak.get(cluster, 0) + 1 if flagged else 0
        if cluster in self.quarantined:
            self.passed[cluster] = 0 if flagged else self.passed.get(cluster, 0) + 1
            if self.passed[cluster] >= k:
                self.quarantined.discard(cluster)
                self.passed.pop(cluster, None)
        elif self.streak[cluster] >= k:
            self.quarantined.add(cluster)
            self.passed[cluster] = 0

    def readmit(self, cluster: str) -> bool:
        """An operator's readmission (`dilocox readmit`): the site's streaks and quarantine are cleared, so its
        next update counts as any site's. True if it was quarantined."""
        self.streak.pop(cluster, None)
        self.passed.pop(cluster, None)
        if cluster in self.quarantined:
            self.quarantined.discard(cluster)
            return True
        return False


def excluded(verdicts: Iterable[SiteVerdict]) -> set[str]:
    return {v.cluster for v in verdicts if v.excluded}


def clipped(verdicts: Iterable[SiteVerdict]) -> dict[str, float]:
    """Clip factors of the sites merged clipped (mode clip), by cluster."""
    return {v.cluster: v.scale for v in verdicts if v.scale != 1.0}


def margins(verdicts: Iterable[SiteVerdict]) -> dict:
    """The round's closest figures to the thresholds (the lowest cosines, the largest norm ratio): one log
    line per round that shows how far honest sites are from a flag, what the defaults were set from."""
    verdicts = list(verdicts)

    def extreme(pick, values) -> float | None:  # noqa: ANN001
        values = [v for v in values if v is not None and math.isfinite(v)]
        return round(pick(values), 4) if values else None

    return {"max_norm_ratio": extreme(max, (v.norm_ratio for v in verdicts)),
            "min_cosine_others": extreme(min, (v.cosine_others for v in verdicts)),
            "min_cosine_previous": extreme(min, (v.cosine_previous for v in verdicts)),
            "flagged": sorted(v.cluster for v in verdicts if v.reasons)}  # fmt: skip
