"""User-space WAN latency for a shard: every push and pull waits a fixed time before it is served.

This kernel has no `netem`, so link latency cannot come from `tc`; a shard started with
`--added-latency-ms` delays each call instead (bandwidth limits still come from `tc tbf`/`htb`).
Tests and benchmarks use it to put a slow link between clusters and shards on one machine.
"""

from __future__ import annotations

import time
from typing import Iterator

import grpc

from dilocox.common.config.run import WireConfig
from dilocox.proto import dilocox_pb2 as pb
from dilocox.server.servicer import AggregatorServicer
from dilocox.server.shard import Shard


class LatencyServicer(AggregatorServicer):
    def __init__(self, shard: Shard, latency_s: float, wire: WireConfig | None = None) -> None:
        super().__init__(shard, wire)
        if latency_s < 0:
            raise ValueError(f"latency must be ≥ 0, got {latency_s}")
        self.latency_s = latency_s

    def Push(self, request_iterator: Iterator[pb.PushMessage], context: grpc.ServicerContext) -> pb.PushReply:
        time.sleep(self.latency_s)
        return super().Push(request_iterator, context)

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.TensorChunk]:
        time.sleep(self.latency_s)
        yield from super().Pull(request, context)
