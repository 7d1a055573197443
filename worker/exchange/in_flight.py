"""Taking the exchange in flight back in, and what a site's ranks agree on around it: the previous round's
exchange collected at the boundary (`_collect`) or τ steps into the next round (`merge_in_flight`); a refusal
— the shards went on without the site — raised on every rank alike, the round trained on top of it dropped
(`_check_refusal`); the round a late site's work goes to (`_round_to_push`); and the tokens every rank weighs
its slices by (`_check_tokens_agree`).

Mixed into `DilocoCluster` (worker/exchange/cluster.py), whose state it uses (`client`, `access`,
`communicator`, `outgoing`, `buffers`, `version`, …) and whose checkpoint hook it calls (`_commit`); kept
apart so that each part of the loop stays readable.
"""

from __future__ import annotations

import grpc
import structlog

from dilocox.worker.exchange.communicator import RoundExchange
from dilocox.worker.exchange.shard_wait import AggregatorError
from dilocox.worker.exchange.stop import wait_exchange

log = structlog.get_logger()


def _refused_elsewhere() -> AggregatorError:
    return AggregatorError(
        "site", grpc.StatusCode.FAILED_PRECONDITION, "another rank of this site was refused: it rejoins"
    )


class InFlight:
    """Mixed into `DilocoCluster`: `merge_in_flight`, `_collect`, `_check_refusal`, `_round_to_push` and
    `_check_tokens_agree`."""

    def merge_in_flight(self, round_: int, tokens: int) -> None:
        """τ steps into round `round_`: collect the previous round's exchange and take the merged model in
        now, keeping the τ steps' own progress on top (`outgoing.Rebase`); the round's start becomes
        θ − e, so its pseudo-gradient at the boundary is all of its own progress. The boundary then finds
        nothing in flight and goes on from the model as it is (the `own` rule without a θ). Streaming
        DiLoCo's overlap of τ steps (arXiv 2501.18512) with its α = 0 and this framework's start rule."""
        exchange, idle, refused = self._collect()
        self._check_stop(exchange)
        self._check_refusal(round_, refused, tokens)
        assert exchange is not None and self.outgoing is not None
        self._commit(exchange.round)
        skipped = exchange.version > self.version + 1  # caught up on rounds closed without this site
        self.version = exchange.version
        self.access.read_rows(self.outgoing.rebase(self.client.held), keep_buffer=self.buffers.spill is None)
        self.access.write(self.buffers.start)
        self._start_from_held(keep_unsent=True)
        self.buffers.rest_start()
        self._merged = (exchange, idle, self._steps, skipped)

    def _check_tokens_agree(self, round_: int, tokens: int) -> None:
        """Every rank of a site weighs its slices by the same tokens (the site's): a rank passing its own
        share would weigh its parameters differently from the others'. Refused alike on every rank."""
        low, high = self.access.agree_min(int(tokens)), self.access.agree_max(int(tokens))
        if low != high:
            raise ValueError(
                f"round {round_}: the site's ranks report different tokens ({low} to {high}); every rank "
                f"must pass the whole site's tokens (the same number) to step()/close_round"
            )

    def _round_to_push(self, round_: int, version: int) -> int:
        """The round this boundary's pseudo-gradient goes to: the one trained, unless the shards have
        already closed it (a late site under quorum + grace: server/rounds/round_close.py), then the one after the
        version the site holds — never past the run's last round, whose refusal the carry keeps for the
        end-of-run flush. A site slower than the grace window every round finds that round closed too, every
        time (tests/test_uneven_sites.py, an expected failure: see docs/decisions.md)."""
        return max(round_, min(version + 1, self.rounds))

    def _collect(self) -> tuple[RoundExchange | None, float, AggregatorError | None]:
        """Collect the exchange in flight. A refusal (FAILED_PRECONDITION: the shards went on without us)
        is returned, not raised, so that the site can agree on it first (`_check_refusal`), which then
        discards the round trained on top of it. What the refusing shard lacked is carried into the next
        push by the client."""
        try:
            waited = wait_exchange(self.communicator, self._stop, log)
            if waited is None:  # a stop came while this rank waited, and the exchange had its grace
                self._stop_waited = True
                return None, 0.0, None
            exchange, idle = waited
            return exchange, idle, None
        except AggregatorError as error:
            if error.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return None, 0.0, error

    def _check_refusal(self, round_: int, refused: AggregatorError | None, tokens: int) -> None:
        """Raise the refusal on every rank of the site if any rank had one (they rejoin together); the
        round just trained is dropped."""
        if not self.access.agree_any(refused is not None):
            return
        self.client.traffic.dropped_rounds += 1
        self.client.traffic.dropped_tokens += int(tokens)
        log.warning(
            "local_round_dropped",
            cluster=self.client.cluster,
            round=round_,
            tokens=int(tokens),
            reason=refused.details if refused else "another rank of the site was refused",
        )
        raise refused or _refused_elsewhere()
