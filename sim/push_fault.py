"""A faulty site for drills: a client whose pushes pass through a fault before they leave.

Why here and not in the client: the fault is a benchmark's and a test's tool (`dilocox bench faults`,
bench/fault_kinds.py), never a production setting, so `AggregatorClient` carries no hook for it; the
in-process run (`sim/inprocess.py`, `push_fault=`) builds this subclass in its place only when a fault
is given, and a run without one is the same code and the same numbers as before.

The fault sees each slice as encoded for the wire (codec, payload), after the site's compressor has
settled its error feedback on the honest update: what goes wrong is what the shards receive, as with a
bug in the site's sending path, a silent corruption of the values it sends, or an old update pushed
again. What is sent is also what the site keeps to replay its round (as a real faulty site would), so
the shards and the site stay bit-exact with each other and the drill measures the fault, not a replay
mismatch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dilocox.common.wire.framing import EncodedSlice, SliceKey
from dilocox.worker.exchange.aggregator_client import AggregatorClient

# (cluster, round, slice as encoded) -> the slice to send instead (the same object: unchanged)
PushFault = Callable[[str, int, EncodedSlice], EncodedSlice]


class FaultyPushClient(AggregatorClient):
    """`AggregatorClient` whose round ≥ 1 slices go through `fault` after encoding (round 0, the initial
    weights, is never touched: a drill's fault is in the updates)."""

    def __init__(self, *args, fault: PushFault, **kwargs) -> None:  # noqa: ANN002, ANN003 - AggregatorClient's
        super().__init__(*args, **kwargs)
        self.fault = fault

    def _encode(
        self, round_: int, key: SliceKey, tensor: torch.Tensor, codec: str | None = None, formed: bool = False
    ) -> EncodedSlice:
        item = super()._encode(round_, key, tensor, codec, formed)
        if round_ == 0:
            return item
        sent = self.fault(self.cluster, round_, item)
        self._own[key] = sent  # replayed as it was sent, like every site's own part
        return sent
