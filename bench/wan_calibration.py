"""The step `dilocox bench wan` scales its links by: one site's inner step timed on this machine, and the
link rate and AllReduce time that follow from it.

Its own module because the benchmark (wan.py) derives its default link rate from these figures before
anything runs, and its report (wan_report.py) sets the measured ratio against them afterwards: both
read the same arithmetic, here once.
"""

from __future__ import annotations

import torch

from dilocox.bench.allreduce_baseline import ring_bytes_per_rank
from dilocox.common.config.run import RunConfig
from dilocox.worker.data.token_data import TokenData
from dilocox.worker.train.inner_trainer import InnerTrainer


def calibrate(config: RunConfig, data: bytes | TokenData, sites: int, threads: int, steps: int = 10) -> dict:
    """Time the inner step of one site on this machine (after 3 warm-up steps)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        trainer = InnerTrainer(config, data, 0, sites)
        trainer.train_steps(3)
        _, tokens, seconds = trainer.train_steps(steps)
    finally:
        torch.set_num_threads(previous)
    params = sum(p.numel() for _, p in trainer.named_parameters())
    return {
        "step_s": round(seconds / steps, 5),
        "tokens_per_step_per_site": tokens // steps,
        "params": params,
        "allreduce_bytes_per_step_per_site": ring_bytes_per_rank(params, sites),
    }


def allreduce_link_s(calibration: dict, rate_mbit: float) -> float:
    """One step's fp32 AllReduce on the link by bytes / rate (seconds)."""
    return calibration["allreduce_bytes_per_step_per_site"] * 8 / (rate_mbit * 1e6)


def auto_rate_mbit(calibration: dict, ratio: float) -> float:
    """The rate at which one step's AllReduce takes `ratio` × one step's compute."""
    seconds = ratio * calibration["step_s"]
    return round(min(10_000.0, max(0.1, calibration["allreduce_bytes_per_step_per_site"] * 8 / seconds / 1e6)), 3)
