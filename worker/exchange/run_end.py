"""How a cluster's run ends: the run's final version, a late site that finds it published, the last
exchange collected, the error-feedback residuals flushed, and the shards' model adopted.

Mixed into `DilocoCluster` (worker/exchange/cluster.py), whose state it uses (`client`, `access`,
`communicator`, `outgoing`, `checkpoint`, …); kept apart so that each part of the loop stays readable.
"""

from __future__ import annotations

import grpc
import structlog

from dilocox.worker.exchange.aggregator_client import AggregatorError
from dilocox.worker.exchange.communicator import RoundExchange

log = structlog.get_logger()


class RunEnd:
    """Mixed into `DilocoCluster`: `final_version`, `finish` and the end-of-run flush."""

    @property
    def final_version(self) -> int:
        """The run's last version on the shards: its rounds, and the end-of-run flush where there is one."""
        compressor = self.client.compressor
        return self.rounds + (1 if compressor is not None and compressor.flushes else 0)

    def _run_over_without(self, trained: int, tokens: int, version: int) -> bool:
        """Whether the shards have published the run's final version already (a late site under quorum +
        grace can collect it while it still trains): then round `trained` can go nowhere, and the site ends
        on the shards' model. Counted like a round dropped at a rejoin."""
        if not self.access.agree_any(version >= self.final_version):  # one rank's view ends it for all
            return False
        self.client.traffic.dropped_rounds += 1
        self.client.traffic.dropped_tokens += int(tokens)
        log.warning(
            "late_work_not_delivered",
            cluster=self.client.cluster,
            round=trained,
            tokens=int(tokens),
            version=version,
            reason="the shards closed the run's last round without this site",
        )
        return True

    def finish(self) -> None:
        """End on the global model, the same in both forms: collect θ_T (delay=1: it is still in flight),
        flush the error-feedback residuals, and adopt the shards' weights without any local residual."""
        adopt = self._adopt_held
        if self.communicator.in_flight is not None:
            exchange, idle = self.communicator.collect()
            self._commit(exchange.round)
            self.version = exchange.version
            adopt = True
            log.info(
                "last_round_collected",
                cluster=self.client.cluster,
                version=exchange.version,
                idle_s=round(idle, 3),
                bytes_up=exchange.bytes_up,
                bytes_down=exchange.bytes_down,
            )
        flushed = self._flush_residuals()
        if flushed is not None:
            adopt = True
        if self.access.agree_any(adopt):  # every rank writes, or none (the write is collective)
            # ... and every rank adopts one version: the newest any rank of the site was given (a late site's
            # ranks can hold different ones at the end; each would otherwise write its own)
            newest = self.access.agree_max(max(self.version, self.client.newest_version))
            self.version = max(self.version, self.client.catch_up_replica(self.names, to=newest))
            self._start_from_held(keep_unsent=False)
            self.access.write(self.buffers.start)
            self.buffers.rest_start()
            log.info("final_weights_adopted", cluster=self.client.cluster, version=self.version)
        if self.checkpoint is not None and not self.access.agree_any(flushed is None):
            # The state after the flush (residuals sent, so none kept): what a run extended with more
            # rounds resumes from, so nothing the flush sent is sent again (docs/deploy.md, "Train longer").
            self.checkpoint.capture(
                flushed.round, self.trainer, self.client.compressor, self.names, always=True, client=self.client
            )
            self._commit(flushed.round)

    def _flush_residuals(self) -> RoundExchange | None:
        """Round `rounds + 1` without inner steps: a zero pseudo-gradient pushed with the dense flush
        codec, so that error feedback sends exactly what the compressed rounds held back. Returns its
        exchange, or None when nothing is to be flushed or the shards have already closed that round
        without it. (A worker resumed after its run had ended finds its own flush in that round: the
        shards answer the repeated push as a duplicate and it ends on their model.)"""
        compressor = self.client.compressor
        if compressor is None or not compressor.flushes:
            return None
        round_ = self.rounds + 1
        held_back = compressor.residual_norm()
        if self.access.agree_any(max(self.version, self.client.newest_version) >= round_):  # every rank alike
            # A late site (quorum + grace) can collect the flush round itself: the shards closed it without
            # us and the run is over on them, so nothing of ours can go anywhere any more.
            log.warning(
                "residuals_not_flushed",
                cluster=self.client.cluster,
                round=round_,
                version=self.version,
                residual_norm=round(held_back, 4),
                carried_slices=len(list(self.client.carry.pending_keys())),
                reason="the shards closed the run's last round without this site",
            )
            return None
        # With error feedback the outgoing buffer holds the residual: sent as it is, as a zero Δ would add it
        self.communicator.submit(
            round_, self._last_weight, self.outgoing.outgoing_slices(), codec=compressor.config.flush_codec, formed=True
        )
        try:
            exchange, idle = self.communicator.collect()
        except AggregatorError as error:
            if error.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("residuals_not_flushed", cluster=self.client.cluster, round=round_, reason=error.details)
            return None
        self.version = exchange.version
        self.flush = {
            "round": round_,
            "codec": compressor.config.flush_codec,
            "residual_norm": round(held_back, 4),
            "bytes_up": exchange.bytes_up,
            "bytes_down": exchange.bytes_down,
            "comm_s": round(exchange.comm_s, 3),
        }
        log.info(
            "residuals_flushed",
            cluster=self.client.cluster,
            version=exchange.version,
            idle_s=round(idle, 3),
            **self.flush,
        )
        return exchange
