"""Each site's update is looked at before the shard merges it: its size, its direction, whether it is new.

Why: the sites of a run belong to different organisations, and each is a place where things go wrong — a
GPU with silent data corruption, a fork with a bug, a data pipeline feeding garbage, a site restored from
the wrong checkpoint. Without a check, whatever a joined site pushes is averaged into every site's model.

What a shard computes per round, on the slices it owns, from the payloads as they came (a low-rank
payload through its factors, never its product; server/checks/round_figures.py): what it needs of the Gram matrix G
of the sites' updates (G_ij = ⟨Δ_i, Δ_j⟩, summed over slices) and each update's inner product with the
previous round's global update, from the contributions the shard keeps for replay. From them, per site:

* `norm_ratio` — ‖Δ_i‖ over its reference norm: the median of the norms this shard accepted from the *other*
  sites over the last `history` rounds (so a site cannot raise its own bar by growing a little each round), or,
  before any, the median of this round's other norms where two or more;
* `cosine_others` — cos(Δ_i, the mean of the other sites' updates, each as a unit vector (one vote a site) and the
  outsized ones left out, so one huge update cannot drown the others' direction), with three or more sites;
  with two, the cosine of the pair;
* `cosine_previous` — cos(Δ_i, the previous round's global update: the weighted mean of the contributions
  it merged), from the second round on. Reported, and a tie-breaker only: honest sites' consecutive rounds
  can point in unrelated directions (a learning-rate or data-mix change, a momentum swing), and judged
  against it alone the check once excluded all four honest sites of a round. (Not the outer
  momentum: against a dense buffer a low-rank update costs rows × cols × rank per site.)
* `replayed` — its whole contribution here (every payload, byte for byte) equal to one this shard received
  in the last `history` rounds, from any site (an old round's update pushed again); a zero update is not
  counted (it carries nothing to replay).

A site is judged against its peers in the round. It is flagged when its figures are not finite (an update so
large that its squared norm exceeds fp32's range), its norm ratio exceeds `norm_ratio`, its cosine with the
others is below `min_cosine` *and* opposes them — below −`OPPOSITION` × the median of the other sites' own
cosines, where the others agree among themselves (mean pairwise cosine ≥ `min_agreement`; with two sites:
the pair's cosine is below −`min_agreement`, and this site's cosine with the previous update is below
`min_cosine` and below the other's — the previous direction breaks a tie, never flags alone), or it replayed. **Never a
majority**: where more than `max_flagged` of the round's sites would be acted on
(flagged, or quarantined), the check is wrong about the round, not the sites — nobody is left out or clipped
(but an overflowing update, which would turn every weight to inf), no streak counts, every verdict says
`overruled`, the shard logs one `update_check_overruled` line, and the round's norms join the history (the
new normal after a schedule change). The end-of-run flush (residuals, not an update) is not judged at all;
flagged `quarantine_rounds` rounds in a row it is quarantined: under `exclude` and `clip` left out of every
round, passing or not, until it passes `quarantine_rounds` rounds in a row (its statistics are still
computed) or an operator readmits it (`dilocox readmit`). One clean round is not enough: a faulty site that
passes now and then would slip a faulty update into every round it happens to pass. `mode`: `off`; `warn` (log, count,
merge anyway: the default);
`exclude` (a flagged or quarantined site's contributions are left out of the round — flagged for its
direction alone, only once quarantined: one round's cosine is noisy late in training — so its version and
the contributions every site replays from are made without them — the clients' replay stays bit-exact
because what is left out is simply not forwarded); `clip` (an update whose only flag is its size is
merged scaled down to the reference norm, c·Δ with c = reference / ‖Δ‖, at its full weight — the
honest sites' mean is neither inflated by it nor diluted; any other flag leaves the update out, as
`exclude` does, and so does quarantine. The factor travels with the forwarded contribution (proto
`scale`), so every replay computes the same c·w). Each shard decides on its own slices; a site faulty on all of its
update is
flagged by every shard alike.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from dilocox.common.wire.peer_median import median_without, medians_of_others
from dilocox.server.checks.round_figures import RoundFigures
from dilocox.server.checks.site_verdict import SiteVerdict

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
    max_flagged: float = 0.5  # act (exclude, clip) only while at most this share of the round's sites is flagged
    min_agreement: float = 0.05  # judge a direction only where the others' mean pairwise cosine is at least this

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--update-check must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.norm_ratio > 1:
            raise ValueError(f"--update-check-norm-ratio must be > 1, got {self.norm_ratio}")
        if not -1 <= self.min_cosine < 1:
            raise ValueError(f"--update-check-min-cosine must be in [-1, 1), got {self.min_cosine}")
        if not 0 <= self.min_agreement < 1:
            raise ValueError(f"--update-check-min-agreement must be in [0, 1), got {self.min_agreement}")
        if not 0 < self.max_flagged <= 1:
            raise ValueError(f"--update-check-max-flagged must be in (0, 1], got {self.max_flagged}")
        if self.quarantine_rounds < 1 or self.history < 1:
            raise ValueError("--update-check-quarantine-rounds and the history must be ≥ 1")


def _cosine(dot: float, a_sq: float, b_sq: float) -> float | None:
    return dot / (a_sq * b_sq) ** 0.5 if a_sq > 0 and b_sq > 0 else None


class UpdateCheck:
    """The check's memory across rounds (accepted norms, payload digests, flag streaks) and its verdicts."""

    def __init__(self, config: UpdateCheckConfig | None = None) -> None:
        self.config = config or UpdateCheckConfig()
        self._norms: deque[list[tuple[str, float]]] = deque(maxlen=self.config.history)  # (cluster, norm) accepted
        self._digests: deque[set[bytes]] = deque(maxlen=self.config.history)
        self.streak: dict[str, int] = {}  # cluster -> rounds flagged in a row
        self.passed: dict[str, int] = {}  # quarantined cluster -> rounds passed in a row since
        self.quarantined: set[str] = set()
        self.last_flagged: frozenset[str] = frozenset()  # flagged in the last round reviewed: not a reference

    def review(self, figures: RoundFigures, judged: bool = True) -> list[SiteVerdict]:
        """The round's verdicts. `judged=False` (the end-of-run flush: residuals, not a training round's
        update): figures only — no flag, no streak, no norm into the history; a quarantine still holds."""
        cfg, clusters = self.config, figures.clusters
        # A site whose own figures overflow (an exponent flipped to huge values) is flagged as such and
        # left out of every other site's figures, which would otherwise turn NaN and pass unflagged.
        sq = figures.sq_norms.clone()
        bad = {i for i in range(len(clusters)) if not float(sq[i]) <= FP32_MAX}  # NaN too
        for i in bad:
            sq[i] = 0.0
        norms = [math.inf if i in bad else max(0.0, float(sq[i])) ** 0.5 for i in range(len(clusters))]
        ratios = self._ratios(clusters, norms)
        seen = set().union(*self._digests) if self._digests else set()
        # The others' direction: each site's update as a unit vector, one vote a site (not its tokens: a claim
        # a site makes, and one claiming 1000x would otherwise *be* "the others" for every honest site),
        # outsized or overflowing ones left out, so one huge update cannot make every honest one look
        # orthogonal to the others.
        suspect = bad | {i for i, r in enumerate(ratios) if r is not None and r > cfg.norm_ratio}
        w = torch.tensor(
            [0.0 if i in suspect or norms[i] == 0 else 1.0 / norms[i] for i in range(len(clusters))],
            dtype=torch.float64,
        )
        gw, wgw = figures.weighted(w) if len(clusters) >= 3 else (None, 0.0)
        weighted_sites = int((w != 0).sum())
        pair = self._pair_cosine(figures, sq) if len(clusters) == 2 and not bad else None
        cos_prev = [self._cos_previous(figures, sq, i, bad) for i in range(len(clusters))]
        against = [self._against_others(i, w, gw, wgw, sq, weighted_sites) for i in range(len(clusters))]
        cosines = [cosine for cosine, _ in against]
        low = lambda c: c is not None and c < cfg.min_cosine  # noqa: E731
        figures_of, reasons_of = [], []
        for i, cluster in enumerate(clusters):
            ratio = ratios[i]
            cos_others, agreement = against[i] if against[i][0] is not None else (pair, None)
            replayed = norms[i] > 0 and figures.contribution_digests.get(cluster) in seen
            # A direction is judged only where the peers' own agreement makes one meaningful: late in training
            # honest updates are mostly noise (pairwise cosines of ±0.02), and a bound at 0 flagged and then
            # quarantined honest sites over a 200-round run.
            if len(clusters) == 2:  # two sites that disagree: the previous update breaks the tie, never alone
                other = cos_prev[1 - i]
                clear = pair is not None and pair < min(cfg.min_cosine, -cfg.min_agreement)
                disagrees = clear and low(cos_prev[i]) and (other is None or cos_prev[i] < other)
            elif agreement is not None:  # decided below, against the other sites' own cosines
                disagrees = low(cos_others) and agreement >= cfg.min_agreement
            else:  # one other site to compare with: as a pair
                disagrees = low(cos_others) and cos_others < -cfg.min_agreement
            if disagrees and agreement is not None:
                disagrees = _opposed(i, cos_others, cosines)
            outsized = ratio is not None and ratio > cfg.norm_ratio
            flagged = i in bad or outsized or disagrees or replayed  # the previous direction alone flags nothing:
            reasons = tuple(
                r
                for r, hit in (
                    ("non_finite", i in bad),
                    ("outsized", outsized),
                    ("disagrees", disagrees),
                    ("against_previous", flagged and low(cos_prev[i])),
                    ("replayed", replayed),
                )
                if hit
            )
            figures_of.append((norms[i], ratio, cos_others, cos_prev[i], replayed))  # it is a note beside a flag
            reasons_of.append(reasons if judged else ())
        # A site pushing another's update byte for byte (free-riding, or doubling one site's say) is not judged
        # — which of the two is the copy cannot be told — but counted once (`copied_weights`).
        same: dict[bytes, int] = {}
        for i, cluster in enumerate(clusters):
            digest = figures.contribution_digests.get(cluster)
            if digest is not None and norms[i] > 0:
                same[digest] = same.get(digest, 0) + 1
        copies = [
            same.get(figures.contribution_digests.get(c), 1) if norms[i] > 0 else 1 for i, c in enumerate(clusters)
        ]
        # Never act on a majority: a check that flags most of a round is wrong about the round, not the sites.
        # Overflowing updates are left out regardless (merged, they would turn every weight to inf or NaN).
        acting = cfg.mode in ("exclude", "clip")
        would = {c for c, r in zip(clusters, reasons_of) if r and r != ("non_finite",)} | (
            self.quarantined & set(clusters)
        )
        overruled = judged and len(would) > cfg.max_flagged * len(clusters)
        if judged and not overruled:
            for cluster, reasons in zip(clusters, reasons_of):
                self._count(cluster, bool(reasons))
        verdicts = []
        for i, cluster in enumerate(clusters):
            reasons, quarantined, scale = reasons_of[i], cluster in self.quarantined, 1.0
            if overruled:  # a quarantine stands (decided in a round where at most max_flagged was flagged)
                excluded = acting and (i in bad or quarantined)
            elif cfg.mode == "clip" and reasons == ("outsized",) and not quarantined:
                scale = 1.0 / ratios[i]  # ratio > norm_ratio > 1: clipped to the reference norm
                excluded = False
            else:
                # A direction alone (noisy late in training: an honest site's cosine dipped to −0.1 against peers
                # near +0.1 on a 200-round run) leaves a site out only once repeated, by quarantine; a size, a
                # replay or an overflow at once.
                direction_only = set(reasons) <= DIRECTION_REASONS
                excluded = acting and ((bool(reasons) and not direction_only) or quarantined)
            verdicts.append(
                SiteVerdict(cluster, *figures_of[i], reasons, quarantined, excluded, scale, overruled, copies[i])
            )
        if judged:  # an overruled round's norms are the new normal (a learning-rate change moves every site)
            accepted = [(v.cluster, v.norm) for v in verdicts if math.isfinite(v.norm) and (overruled or not v.reasons)]
            if accepted:
                self._norms.append(accepted)
        self._digests.append(set(figures.contribution_digests.values()))
        self.last_flagged = frozenset(v.cluster for v in verdicts if v.reasons and not v.overruled)
        return verdicts

    def _ratios(self, clusters: tuple[str, ...] | list[str], norms: list[float]) -> list[float | None]:
        """Each ‖Δ_i‖ over its reference: the median of the norms accepted from the *other* sites over the last
        `history` rounds (a site cannot move its own reference, e.g. by growing a little every round), or,
        before any, the median of this round's other finite norms where two or more (three sites in all).
        One sort of the history for every site (common/wire/peer_median.py)."""
        accepted = [(c, x) for round_ in self._norms for c, x in round_]
        ordered = sorted(x for _, x in accepted)
        own: dict[str, list[float]] = {}
        for c, x in accepted:
            own.setdefault(c, []).append(x)
        finite = {j: x for j, x in enumerate(norms) if math.isfinite(x)}
        in_round = medians_of_others(finite)
        ratios = []
        for i, cluster in enumerate(clusters):
            reference = median_without(ordered, sorted(own.get(cluster, ())))
            if reference is None:  # no other site's norm accepted yet: this round's others, two or more
                others = len(finite) - (i in finite)
                reference = None if others < 2 else in_round[i] if i in finite else statistics.median(finite.values())
            ratios.append(norms[i] / reference if reference is not None and reference > 0 else None)
        return ratios

    @staticmethod
    def _against_others(
        i: int, w: torch.Tensor, gw: torch.Tensor | None, wgw: float, sq: torch.Tensor, weighted_sites: int
    ) -> tuple[float | None, float | None]:
        """(cos(Δ_i, the others' unit vectors summed), the others' mean pairwise cosine), three or more sites;
        (None, None) where there is no other. ‖Σ û_j‖² = m + Σ_{j≠k} cos(û_j, û_k) gives the second."""
        others = weighted_sites - int(w[i] != 0)
        if gw is None or others <= 0:
            return None, None
        own, g_ii, gw_i = float(w[i]), float(sq[i]), float(gw[i])  # others = w less site i: its own term taken back out
        dot, rest = (gw_i - own * g_ii, wgw - 2 * own * gw_i + own * own * g_ii) if own else (gw_i, wgw)
        return _cosine(dot, g_ii, rest), (rest - others) / (others * (others - 1)) if others >= 2 else None

    @staticmethod
    def _pair_cosine(figures: RoundFigures, sq: torch.Tensor) -> float | None:
        """cos(Δ_0, Δ_1) of a two-site round, through the figures' weighted product (G e_0)."""
        gw, _ = figures.weighted(torch.tensor([1.0, 0.0], dtype=torch.float64))
        return _cosine(float(gw[1]), float(sq[0]), float(sq[1]))

    @staticmethod
    def _cos_previous(figures: RoundFigures, sq: torch.Tensor, i: int, bad: set[int]) -> float | None:
        # None where the previous update's own figures overflow fp32 (a faulty one merged: warn mode)
        if i in bad or not figures.previous_sq <= FP32_MAX:
            return None
        cos = _cosine(float(figures.with_previous[i]), float(sq[i]), figures.previous_sq)
        return cos if cos is not None and math.isfinite(cos) else None

    def as_state(self) -> dict:
        """What a shard checkpoint keeps (a restarted shard must not forget a quarantine): small."""
        return {
            "norms": [[[c, x] for c, x in n] for n in self._norms],
            "digests": [sorted(d) for d in self._digests],
            "streak": dict(self.streak),
            "passed": dict(self.passed),
            "quarantined": sorted(self.quarantined),
            "last_flagged": sorted(self.last_flagged),
        }

    def load_state(self, state: dict) -> None:
        # (cluster, norm) pairs; a checkpoint from before the reference left each site out kept bare norms
        self._norms.extend(
            [(c, x) for c, x in (e if isinstance(e, list) else ("", e) for e in n)] for n in state.get("norms", [])
        )
        self._digests.extend(set(d) for d in state.get("digests", []))
        self.streak, self.passed = dict(state.get("streak", {})), dict(state.get("passed", {}))
        self.quarantined, self.last_flagged = (
            set(state.get("quarantined", [])),
            frozenset(state.get("last_flagged", [])),
        )

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


DIRECTION_REASONS = frozenset({"disagrees", "against_previous"})
OPPOSITION = 0.5  # a site is opposed when its cosine is below minus this × the median of the other sites' cosines


def _opposed(i: int, cosine: float, cosines: list[float | None]) -> bool:
    """Site i points against its peers, not merely off them: its cosine with the others below −OPPOSITION × the
    median of the other sites' own cosines (a sign flip sits near minus an honest cosine; an honest site's
    noise, over a 200-round run, dipped to −0.036 while its peers sat near +0.08)."""
    peers = [c for j, c in enumerate(cosines) if j != i and c is not None and math.isfinite(c)]
    if not peers:
        return False
    typical = statistics.median(peers)
    return typical > 0 and cosine < -OPPOSITION * typical
