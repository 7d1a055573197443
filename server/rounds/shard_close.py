"""How a shard closes a round (the half of `Shard` that turns an open round into a published version).

A close is decided and sealed under the shard's lock, stepped outside it, and published under it again
(docs/decisions.md, "The shard steps a round outside its lock"): at model size the weighted mean and outer
step take seconds per shard, and joins, status and pulls of other versions need not wait for them. The
deadline timer and `tick` drive closes that no push triggers (a deadline, a grace window)."""

from __future__ import annotations

import hmac
import threading
import time

import structlog

from dilocox.common.wire.errors import CheckOff, NotAnOperator
from dilocox.server.checks.robust_mean import clip_factors
from dilocox.server.checks.round_figures import round_figures
from dilocox.server.checks.site_verdict import SiteVerdict, clipped, copied_weights, excluded, margins
from dilocox.server.rounds.round_close import CloseDecision, SiteRecord, arrival_spread, decide, first_round_waits
from dilocox.server.rounds.round_state import RoundAccumulator
from dilocox.server.shard_records import RoundStats, SealedRound, Snapshot
from dilocox.server.state.provenance_chain import ChainedVersion, chain_round

log = structlog.get_logger("dilocox.shard")


class RoundClosing:
    """Mixed into `Shard`: the close and the timer that ticks it. Uses the shard's state and lock
    (`_cond`, `accumulator`, `snapshot`, `members`, `optimizer`, …), defined in `Shard.__init__`."""

    def start_deadline_timer(self) -> threading.Event:
        """Tick in a daemon thread while a deadline or a grace window is set; set the returned event to stop it."""
        stop = threading.Event()
        if self.round_deadline_s is not None or self.grace is not None:
            # A tenth of the shortest time that can end a round: a close is at most that late.
            bounds = [
                b
                for b in (self.round_deadline_s, self.grace and self.grace.min_s, self.grace and self.grace.max_s)
                if b
            ]
            interval = max(0.01, min(0.2, min(bounds, default=0.1) / 10))

            def loop() -> None:
                while not stop.wait(interval):
                    self.tick()

            threading.Thread(target=loop, name=f"shard-{self.shard_index}-deadline", daemon=True).start()
        return stop

    def tick(self, now: float | None = None) -> bool:
        """Close the open round if its deadline or grace window has passed with enough contributions
        (called periodically; never with the lock held)."""
        return self._close_if_due(now)

    def _close_if_due(self, now: float | None = None) -> bool:
        """Close the open round if `decide` says so: decided and sealed under the lock, the weighted mean
        and outer step computed outside it, published under it again. Why outside: at model size the
        step takes seconds per shard, and joins, status, and pulls of other versions need not wait for
        it. While it runs the round is closed to pushes (a retry of an included push is a duplicate) and,
        when it updates in place, the version it updates is handed to no new pull. Call without the lock."""
        with self._cond:
            closing = self._begin_close(now)
        if closing is None:
            return False
        try:
            verdicts = self._check_updates(closing)
            new, update_s = self._step_round(closing)
            chained = chain_round(
                closing.acc,
                closing.decision,
                new,
                self.optimizer.buffers,  # the rounds chain's record
                {v.cluster: v.record() for v in verdicts} if verdicts else None,
            )
        except BaseException:
            with self._cond:  # nothing published: the round stays open with what it had
                self.accumulator, self._round_closing = closing.acc, None
                self._notify_waiters()
            raise
        with self._cond:
            self._finish_close(closing, new, update_s, verdicts, chained)
        return True

    def _begin_close(self, now: float | None) -> SealedRound | None:
        acc = self.accumulator
        if acc is None or self.snapshot is None or acc.round != self.open_round or self._round_closing is not None:
            return None
        now = time.monotonic() if now is None else now
        if first_round_waits(
            acc.round, len(self.known), self.expect_clusters, acc.first_push_at, now, self.round_deadline_s
        ):
            return None
        decision = decide(
            acc,
            self.members,
            set(self.owned),
            self.min_clusters,
            now,
            self.round_deadline_s,
            self.grace,
            self.last_seen,
        )
        if decision is None:
            return None
        self._settle_membership(acc, decision)
        flush = acc.round == self.recorded.flush_version
        for cluster, (declared, least) in ({} if flush else acc.understated_ages()).items():
            log.warning(
                "staleness_understated",
                shard=self.shard_index,
                cluster=cluster,
                round=acc.round,
                declared=declared,
                least=least,
                trained_from=acc.trained_from[cluster],
                reason="work pushed by a site that had pulled no newer version is at least "
                "this old: weighed by that age, and capped as stale work",
            )
        for cluster, (age, said, claimed, weight) in acc.weigh(
            self.max_weight_multiple, self.stale_rule, check_ages=not flush
        ).items():
            if claimed != said:
                log.warning(
                    "token_claim_capped",
                    shard=self.shard_index,
                    cluster=cluster,
                    round=acc.round,
                    tokens=said,
                    weight=claimed,
                    multiple=self.max_weight_multiple,
                    reason="a site weighs at most --max-weight-multiple times the median of the others' tokens",
                )
            if weight != claimed:
                log.warning(
                    "stale_contribution_capped",
                    shard=self.shard_index,
                    cluster=cluster,
                    round=acc.round,
                    staleness=age,
                    tokens=said,
                    weight=weight,
                    reason="work older than the round weighs at most the mean of the on-time contributions",
                )
        # In place only when no pull streams the current version; none is handed out until the publish.
        closing = SealedRound(acc, decision, self.snapshot, in_place=not self._readers.get(id(self.snapshot)))
        self.accumulator, self._round_closing = None, closing
        return closing

    def _check_updates(self, closing: SealedRound) -> tuple[SiteVerdict, ...]:
        """Each site's update looked at before the merge (server/checks/update_check.py); in `exclude` mode a
        flagged or quarantined site's contributions leave the sealed round, so neither the step nor what
        the version forwards for replay holds them. No lock held, as for the step."""
        robust = self.aggregate.rule == "clipped-mean"
        if (self.update_check is None and not robust) or not closing.acc.contributions:
            return ()
        check = self.update_check
        figures = round_figures(
            closing.acc.contributions, closing.snapshot.contributions, check.last_flagged if check else frozenset()
        )
        flush = closing.acc.round == self.recorded.flush_version  # residuals, not a training round's update
        verdicts = tuple(check.review(figures, judged=not flush)) if check else ()
        out = excluded(verdicts)
        if out:
            closing.acc.keep_only(set(closing.acc.cluster_weights) - out)
        copied = (
            copied_weights(verdicts, closing.acc.used_weights(), figures.contribution_digests)
            if check and check.config.mode in ("clip", "exclude")
            else {}
        )
        if copied:
            closing.acc.reweigh(copied)
            log.warning(
                "update_copies_counted_once",
                shard=self.shard_index,
                round=closing.acc.round,
                weights={c: round(w, 4) for c, w in sorted(copied.items())},
                reason="byte-identical contributions from several sites: which is the copy cannot be told, so "
                "together they weigh one",
            )
        factors = clipped(verdicts)
        if robust:  # --aggregate clipped-mean: no site's update past a multiple of its peers' median (the flush's too)
            norms = {c: float(sq) ** 0.5 for c, sq in zip(figures.clusters, figures.sq_norms.tolist()) if c not in out}
            bounded = clip_factors(norms, self.aggregate.clip_multiple)
            for cluster, factor in bounded.items():
                factors[cluster] = min(factor, factors.get(cluster, 1.0))
            if bounded:
                log.info(
                    "round_clipped",
                    shard=self.shard_index,
                    round=closing.acc.round,
                    multiple=self.aggregate.clip_multiple,
                    factors={c: round(f, 6) for c, f in sorted(bounded.items())},
                )
        if factors:
            closing.acc.clip(factors)
        return verdicts

    def readmit(self, run_id: str, cluster: str, operator_token: str) -> bool:
        """An operator releases `cluster` from the update check's quarantine (`Readmit` RPC, `dilocox readmit`):
        its next update is looked at as any site's. Needs the shard's operator token (`--operator-token`), which
        sites do not hold — a quarantined site cannot release itself. True if it was quarantined here."""
        self._check_run(run_id)
        if not self.operator_token:
            raise NotAnOperator(
                "this shard takes no operator requests: start it with --operator-token (or $DILOCOX_OPERATOR_TOKEN)"
            )
        if not hmac.compare_digest(operator_token.encode(), self.operator_token.encode()):
            raise NotAnOperator("wrong operator token")
        if self.update_check is None:
            raise CheckOff("this shard's update check is off (--update-check off): nobody is quarantined")
        with self._cond:
            was = self.update_check.readmit(cluster)
            if cluster in self.sites:
                self.sites[cluster].quarantined = False
        log.warning("site_readmitted", shard=self.shard_index, cluster=cluster, was_quarantined=was, by="operator")
        return was

    def _step_round(self, closing: SealedRound) -> tuple[dict, float]:
        """The outer step of every owned slice on the round's weighted mean (no lock held: only this
        thread touches the sealed accumulator, the optimiser and, in place, the sealed version)."""
        new = {}
        started = time.perf_counter()
        for key, param in closing.snapshot.tensors.items():
            stepped = closing.acc.apply(key, self.optimizer, param, closing.in_place)
            new[key] = param if stepped is None else stepped
        return new, time.perf_counter() - started

    def _finish_close(
        self,
        closing: SealedRound,
        new: dict,
        update_s: float,
        verdicts: tuple[SiteVerdict, ...] = (),
        chained: ChainedVersion | None = None,
    ) -> None:
        """Publish the stepped round. `chained`: its rounds-chain record, appended before the publish (so a
        checkpoint saved as the version is published holds it), and its digests, cached for the replay checks."""
        acc, decision = closing.acc, closing.decision
        left_out = excluded(verdicts)
        if verdicts:
            log.info(
                "update_checked", shard=self.shard_index, round=acc.round, sites=len(verdicts), **margins(verdicts)
            )
        if any(v.overruled for v in verdicts):
            self.rounds_overruled += 1
            log.warning(
                "update_check_overruled",
                shard=self.shard_index,
                round=acc.round,
                sites=len(verdicts),
                flagged=sorted(v.cluster for v in verdicts if v.reasons),
                max_flagged=self.update_check.config.max_flagged,
                reason="more of the round was flagged than the check may act on: it is wrong about the round, not "
                "the sites; merged as usual, no streak counted (a learning-rate or data change moves every site)",
            )
        for verdict in verdicts:
            self.sites.setdefault(verdict.cluster, SiteRecord()).checked(verdict, acc.round)
            if (verdict.reasons and not verdict.overruled) or verdict.quarantined:
                log.warning(
                    "update_flagged",
                    shard=self.shard_index,
                    cluster=verdict.cluster,
                    round=acc.round,
                    reasons=list(verdict.reasons),
                    quarantined=verdict.quarantined,
                    excluded=verdict.excluded,
                    mode=self.update_check.config.mode,
                    **({"clipped_by": round(verdict.scale, 6)} if verdict.scale != 1.0 else {}),
                    **verdict.figures(),
                )
        # No copy: the optimiser replaces the buffers, or updates them in place only when no pull holds
        # the version they belong to.
        momentum = dict(self.optimizer.buffers)
        latency_s = time.monotonic() - acc.first_push_at if acc.first_push_at is not None else 0.0
        tokens = tuple(sorted(acc.cluster_weights.items()))
        self.last_round = RoundStats(
            acc.round,
            tuple(sorted(decision.include - left_out)),
            tuple(decision.dropped),
            update_s,
            latency_s,
            time.time(),
            decision.late,
            tokens,
            decision.grace_s,
            tuple(sorted(left_out)),
        )
        for cluster, weight in tokens:
            self.sites.setdefault(cluster, SiteRecord()).made(acc.round, weight)
        self._round_closing = None
        if chained is not None:
            self.chain.append(chained.record)
        self._publish(Snapshot(acc.round, new, momentum, acc.contributions, dict(chained.digests) if chained else {}))
        log.info(
            "round_closed",
            shard=self.shard_index,
            round=acc.round,
            clusters=len(decision.include - left_out),
            **({"excluded": sorted(left_out)} if left_out else {}),
            tokens=sum(acc.cluster_weights.values()),
            bytes_in=acc.bytes_in,
            update_s=round(update_s, 4),
            **({"chain_s": round(chained.seconds, 4)} if chained else {}),
            latency_s=round(latency_s, 3),
            **(
                {"late": list(decision.late), "grace_s": round(decision.grace_s, 3)}
                if decision.grace_s is not None
                else {}
            ),
        )
        self._notify_waiters()

    def wait_until_published(self) -> None:
        """(Under the lock.) Until a close in progress has published: its version is not yet whole."""
        self._cond.wait_for(lambda: self._round_closing is None)

    def _settle_membership(self, acc: RoundAccumulator, decision: CloseDecision) -> None:
        """Before a close: mark the dropped inactive (their partial parts are discarded: they carry them),
        count the late, and let the grace window learn the round's arrival spread."""
        for cluster in decision.dropped:
            del self.members[cluster]
            log.warning(
                "cluster_inactive",
                shard=self.shard_index,
                cluster=cluster,
                round=acc.round,
                reason=f"no complete contribution within the {self.round_deadline_s}s deadline"
                if self.grace is None
                else "part of its contribution in when the grace window ended, or silent past the deadline",
            )
        if decision.dropped:
            self.dropped_bytes += acc.keep_only(set(decision.include))
        for cluster in decision.late:
            self.sites.setdefault(cluster, SiteRecord()).missed()
            log.info(
                "cluster_late",
                shard=self.shard_index,
                cluster=cluster,
                round=acc.round,
                grace_s=round(decision.grace_s or 0, 3),
                reason="not in when the grace window ended: its part goes with its next push",
            )
        if self.grace is not None:
            self.grace.observe(arrival_spread(acc, decision))
