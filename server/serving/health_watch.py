"""Health that tells the truth: NOT_SERVING while the shard's work pool cannot take work.

The health service answers from the event loop, which stays free whatever the pool does; so before this
watch a shard whose work threads were all held (then by stalled pushes; now by any work that takes
longer than the traffic allows) answered SERVING while every join, status and push queued. Every
`period_s` the watch times a no-op through the pool: when it has not run within `stall_s`, health turns
NOT_SERVING (`shard_not_serving`, with how long the pool has been stuck) until the no-op runs, then
SERVING again (`shard_serving_again`). Orchestrators act on it: Kubernetes' readiness probe (3 × 10 s)
marks the pod unready, its liveness probe (6 × 20 s) restarts a shard wedged for two minutes, which
resumes from its checkpoint. An event loop that stalls needs no watch: the health call itself goes
unanswered, and the probes fail.

A shard that serves but cannot save its checkpoints is not unhealthy — a restart would only make it older
— so that stays a warning in `dilocox status`, a metric and an alert (server/state/checkpoint.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import structlog
from grpc_health.v1 import health, health_pb2

from dilocox.server.serving.health import NAMES

log = structlog.get_logger()
STALL_S = 60.0  # the default: well above a push's decode or a close's outer step at any tested scale


class ServingWatch:
    def __init__(
        self,
        health_service: health.aio.HealthServicer,
        pool: ThreadPoolExecutor,
        shard_index: int,
        stall_s: float = STALL_S,
        period_s: float = 1.0,
    ) -> None:
        if stall_s <= 0:
            raise ValueError(f"--health-stall-s must be > 0, got {stall_s}")
        self.health, self.pool, self.shard_index = health_service, pool, shard_index
        self.stall_s, self.period_s = stall_s, min(period_s, stall_s)
        self.serving = True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            probe = loop.run_in_executor(self.pool, _nothing)
            try:
                await asyncio.wait_for(asyncio.shield(probe), timeout=self.stall_s)
            except TimeoutError:
                await self._set(
                    False,
                    f"a task has waited {self.stall_s:g}s for one of the work pool's threads "
                    "(joins, status, pushes and pulls wait with it)",
                )
                await probe
                await self._set(True, f"the work pool took a task after {loop.time() - started:.1f}s")
            await asyncio.sleep(self.period_s)

    async def _set(self, serving: bool, reason: str) -> None:
        self.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in NAMES:
            await self.health.set(name, status)  # a no-op once the server is shutting down
        if serving:
            log.info("shard_serving_again", shard=self.shard_index, reason=reason)
        else:
            log.error("shard_not_serving", shard=self.shard_index, reason=reason, stall_s=self.stall_s)


def _nothing() -> None:
    return None
