"""The compressed downlink: what the clusters hold of the global weights, and the change to send them.

Clusters never receive θ_v itself after the first full snapshot. The shard keeps B_v, the weights
every up-to-date cluster holds, and on each new version compresses the change θ_v − B_{v−1}:

    B_v = B_{v−1} + D(C(θ_v − B_{v−1}))

Whatever the compression dropped stays in θ − B and is sent in a later round: the error feedback of
the downlink lives here, on the shard, not in the clusters. Every cluster holding B_{v−1} adds the same
decoded bytes with the same arithmetic, so all reconstruct B_v bit-identically; a cluster that joins
late or falls behind gets B_v in full, once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import structlog
import torch

from dilocox.common.compression import CompressionConfig, Encoded, TensorCompressor
from dilocox.common.framing import SliceKey

log = structlog.get_logger()


@dataclass
class Published:
    """One version as served: B_v per slice, and (if compressed) the change from B_{v−1}."""

    version: int
    weights: dict[SliceKey, torch.Tensor]
    changes: dict[SliceKey, Encoded] = field(default_factory=dict)

    @property
    def base_version(self) -> int | None:
        return self.version - 1 if self.changes else None


class Broadcaster:
    def __init__(self, config: CompressionConfig | None, seed: int = 0) -> None:
        # The change is compressed against B (which already carries what was dropped), so the
        # compressor's own error feedback stays off: it would count the residual twice.
        self.compressor = (
            TensorCompressor(dataclasses.replace(config, error_feedback=False), seed=seed, name="downlink")
            if config is not None and config.codec != "fp32"
            else None
        )
        self.served: Published | None = None

    def publish(self, version: int, theta: dict[SliceKey, torch.Tensor]) -> Published:
        previous = self.served
        if self.compressor is None or previous is None:
            published = Published(version, dict(theta))  # exact: version 0, or no downlink compression
        else:
            weights, changes = {}, {}
            for key, value in theta.items():
                encoded = self.compressor.compress(key, value - previous.weights[key])
                changes[key] = encoded
                weights[key] = previous.weights[key] + encoded.decoded
            published = Published(version, weights, changes)
            drift = sum(float((theta[k] - weights[k]).square().sum()) for k in theta) ** 0.5
            log.debug("downlink_published", version=version, drift=drift)
        self.served = published
        return published

    def state_dict(self) -> dict:
        return {"served": self.served, "compressor": self.compressor.state if self.compressor else None}
