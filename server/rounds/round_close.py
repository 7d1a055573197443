"""Whether a shard closes its open round now, and with whom: the rule, apart from the shard's locking and
publishing (`Shard._close_if_due` applies what `decide` returns).

Three ways a round closes once `min_clusters` clusters have delivered every slice the shard owns:

* every member has delivered: at once, in every mode;
* **deadline** (no grace window): `deadline_s` after the round's first contribution, with the clusters
  that completed it; the others are marked inactive and rejoin (their refused part is carried);
* **quorum + grace**: `grace.seconds()` after the quorum was reached. A member with nothing in
  by then stays a member: it is *late*, its push for the closed round is refused and its client folds it,
  with its tokens, into its next push (worker/exchange/carry.py). A member whose delivery is under way
  (part of its slices in: a pipeline's ranks push their shares apart) gets up to `grace.max_s` more,
  and is marked inactive only if it is still partial then, since part of its round would be applied
  and part carried. With a deadline too, a member that has pushed nothing for `deadline_s` is taken
  for gone and marked inactive, so a crashed site does not stay a member for ever.

A shard decides alone, on its own clock: two shards may close the same round with different clusters.
That split is what the carry already handles (per slice, per shard), so no shard-to-shard agreement is
needed (docs/decisions.md, "Uneven sites").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dilocox.server.rounds.grace import GraceWindow
from dilocox.server.rounds.round_state import RoundAccumulator


@dataclass(frozen=True)
class CloseDecision:
    include: frozenset[str]  # complete clusters: their contributions make the round
    late: tuple[str, ...] = ()  # members with nothing in: they stay, their part comes with their next push
    dropped: tuple[str, ...] = ()  # marked inactive: they rejoin (deadline, gone, or a partial delivery)
    grace_s: float | None = None  # the grace window this round was given (quorum + grace only)


def decide(
    acc: RoundAccumulator,
    members: Mapping[str, float],
    owned: set,
    min_clusters: int,
    now: float,
    deadline_s: float | None = None,
    grace: GraceWindow | None = None,
    last_seen: Mapping[str, float] | None = None,
) -> CloseDecision | None:
    """The close of `acc`'s round at monotonic time `now`, or None to keep it open. Records when each
    cluster completed and when the quorum was reached on `acc` (the grace window is measured from it)."""
    complete = acc.complete_clusters(owned)
    for cluster in complete:
        acc.complete_at.setdefault(cluster, now)
    if len(complete) < min_clusters:
        return None
    if acc.quorum_at is None:
        acc.quorum_at = now
    missing = set(members) - complete
    if not missing:
        return CloseDecision(frozenset(complete))
    if grace is None:
        if deadline_s is None or acc.first_push_at is None or now - acc.first_push_at < deadline_s:
            return None
        return CloseDecision(frozenset(complete), dropped=tuple(sorted(missing)))
    window = grace.seconds()
    waited = now - acc.quorum_at
    partial = acc.partial_clusters(complete) & missing
    if waited < window or (partial and waited < window + grace.max_s):
        return None
    seen = last_seen or {}
    gone = {c for c in missing - partial if deadline_s is not None and now - seen.get(c, now) >= deadline_s}
    late = missing - partial - gone
    return CloseDecision(frozenset(complete), tuple(sorted(late)), tuple(sorted(partial | gone)), window)


def first_round_waits(
    round_: int, joined: int, expect: int, first_push_at: float | None, now: float, deadline_s: float | None
) -> bool:
    """Whether the run's first round must stay open for sites that have not joined yet: until `expect`
    clusters have joined, or (with a deadline) `deadline_s` after its first contribution.

    Why: a quorum (`min_clusters` below the number of sites) would otherwise let the sites that start
    first close round 1 before a slower-starting one has even joined; that one is then refused as a late
    joiner (it would train fewer rounds than the run has). Only round 1: a site that joins later is a
    rejoin, which the quorum and the carry already handle."""
    if round_ != 1 or joined >= expect:
        return False
    return deadline_s is None or first_push_at is None or now - first_push_at < deadline_s


def arrival_spread(acc: RoundAccumulator, decision: CloseDecision) -> float:
    """What the grace window learns from a close: the quorum → last complete delivery time, or the window
    given when someone missed it (the spread was at least that)."""
    if decision.late or decision.dropped:
        return decision.grace_s or 0.0
    if acc.quorum_at is None:
        return 0.0
    return (
        max((acc.complete_at[c] for c in decision.include if c in acc.complete_at), default=acc.quorum_at)
        - acc.quorum_at
    )


@dataclass
class SiteRecord:
    """One cluster's rounds as this shard saw them: `dilocox status` and the metrics show it."""

    rounds_made: int = 0  # rounds closed with its contribution
    rounds_late: int = 0  # rounds closed without it while it stayed a member (its part came later)
    last_round: int = 0  # the last round it made
    last_tokens: float = 0.0  # its weight (tokens) in that round
    inner_steps: int = 0  # H of its last accepted push, as its header said (0: not said)
    idle_s: float = 0.0  # its trainer's idle seconds at the boundary that pushed it, as said
    rounds_flagged: int = 0  # rounds the update check flagged its update (server/checks/update_check.py)
    rounds_excluded: int = 0  # rounds the update check left it out of (mode exclude, or clip)
    rounds_clipped: int = 0  # rounds the update check merged it clipped (mode clip)
    quarantined: bool = False  # flagged rounds in a row: left out (exclude) until a round passes
    last_flag: str = ""  # why it was last flagged (outsized, disagrees, against_previous, replayed)
    last_flag_round: int = 0

    def as_status(self) -> dict:
        """Its fields as a dict. Every field is a scalar, so a shallow copy is the whole record: Status builds
        one per site under the shard's lock, and `dataclasses.asdict`'s recursive copy was 4 % of a shard's
        CPU with 256 sites polled four times a second."""
        return dict(self.__dict__)

    def made(self, round_: int, tokens: float) -> None:
        self.rounds_made += 1
        self.last_round, self.last_tokens = round_, tokens

    def said(self, inner_steps: int, idle_s: float) -> None:
        if inner_steps > 0:
            self.inner_steps, self.idle_s = int(inner_steps), max(0.0, float(idle_s))

    def missed(self) -> None:
        self.rounds_late += 1

    def checked(self, verdict, round_: int) -> None:  # noqa: ANN001 - a site_verdict.SiteVerdict
        self.quarantined = verdict.quarantined
        if verdict.reasons and not verdict.overruled:  # an overruled round is one alert of its own, not one a site
            self.rounds_flagged += 1
            self.last_flag, self.last_flag_round = ",".join(verdict.reasons), round_
        self.rounds_excluded += int(verdict.excluded)
        self.rounds_clipped += int(verdict.scale != 1.0)
