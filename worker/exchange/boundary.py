"""What a round boundary costs: seconds per phase, and the host bytes the exchange keeps per rank.

Phases, in order: `collect` (waiting for the exchange in flight: the trainer's idle time), `checkpoint`
(staging the state for the asynchronous write), `read` (θ of the owned parameters to the host, folded as
it arrives into Δ + e and, for a delayed round, the next start: worker/exchange/outgoing.py), `start` (a
synchronous round's next start from the global weights), `write` (scattering it back into the model) and
`eval`. Logged per round as `boundary_done`, with the rank's resident memory as the round's training ended
(`rss_before_mb`: the steady state between boundaries, which a spilled start is not part of);
`dilocox bench train --layouts` reads them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Iterator

import structlog
import torch

from dilocox.worker.exchange.host_buffers import HostBuffers

log = structlog.get_logger()


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS, from /proc/self/statm); 0 where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class BoundaryTimer:
    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        self.rss_before_mb = round(resident_bytes() / 2**20)  # made as the boundary begins

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] += time.perf_counter() - started

    def seconds(self) -> dict[str, float]:
        return {f"{phase}_s": round(value, 4) for phase, value in self._seconds.items()}


def _tensor_bytes(tensors) -> int:  # noqa: ANN001
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def exchange_bytes(client, buffers: HostBuffers) -> dict[str, int]:  # noqa: ANN001
    """Host bytes this rank keeps for the exchange: the boundary buffers (s and the outgoing buffer), the
    client's replica of the global weights and outer momentum, the compressor's residuals (where they are
    not the outgoing buffer itself) and warm starts, and the payloads of its own last push (kept to replay
    the round). A start spilled to disk (`--spill-dir`) counts apart, as `spilled_bytes`: between boundaries
    it is not in memory (worker/exchange/spill.py)."""
    spilled = buffers.spill.nbytes if buffers.spill is not None else 0
    replica = _tensor_bytes(client.held.values())
    momentum = _tensor_bytes(client.outer.buffers.values()) if client.outer is not None else 0
    compressor = 0
    if client.compressor is not None:
        for state in list(client.compressor.state.values()):
            compressor += _tensor_bytes([state.q]) + (0 if buffers.holds(state.error) else _tensor_bytes([state.error]))
    own = client.own_payload_bytes
    parts = {
        "buffer_bytes": buffers.nbytes - spilled,
        "replica_bytes": replica,
        "momentum_bytes": momentum,
        "compressor_bytes": compressor,
        "own_push_bytes": own,
    }
    return {**parts, "total_bytes": sum(parts.values()), "spilled_bytes": spilled}


def log_exchange_memory(client, buffers: HostBuffers, params_held: int) -> None:  # noqa: ANN001
    """The `exchange_memory` line: each part's bytes and the total per parameter this rank holds."""
    held = exchange_bytes(client, buffers)
    log.info(
        "exchange_memory",
        cluster=client.cluster,
        params_held=params_held,
        params_owned=buffers.numel,
        **held,
        bytes_per_held_param=round(held["total_bytes"] / max(1, params_held), 2),
    )
