"""A cluster rank's local state on disk, so a whole run can be stopped and resumed.

Saved after every k rounds, once the round's pseudo-gradient is on the shards: the local trainer (weights, AdamW state, data position, step), the uplink
compressor (error-feedback residuals, warm-start Q, ranks) and the last finished round. On `--resume`
the rank restores them, rejoins, and adopts the shards' current global weights (which are
authoritative); only the progress of an unfinished round is lost.
"""

from __future__ import annotations

import os
import pathlib

import structlog
import torch

from dilocox.common.atomic_file import atomic_torch_save
from dilocox.common.wire.compression import TensorCompressor

log = structlog.get_logger()


class WorkerCheckpoint:
    def __init__(self, directory: str | os.PathLike, cluster: str, rank: int = 0, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be ≥ 1 round, got {every}")
        self.path = pathlib.Path(directory) / f"worker-{cluster}-rank{rank}.pt"
        self.every = every

    def write(self, round_: int, trainer_state: dict, compressor_state: dict | None) -> None:
        atomic_torch_save({"round": round_, "trainer": trainer_state, "compressor": compressor_state}, self.path)
        log.info("worker_checkpoint_saved", round=round_, path=str(self.path))

    def restore(self, trainer, compressor: TensorCompressor | None) -> int:  # noqa: ANN001
        """Load the saved state into `trainer`/`compressor`; returns the last round it had finished."""
        if not self.path.is_file():
            raise FileNotFoundError(f"no worker checkpoint at {self.path}")
        state = torch.load(self.path, map_location="cpu", weights_only=False)  # our own file
        trainer.load_state_dict(state["trainer"])
        if compressor is not None and state["compressor"] is not None:
            compressor.load_state_dict(state["compressor"])
        log.info("worker_checkpoint_restored", round=state["round"], path=str(self.path))
        return int(state["round"])
