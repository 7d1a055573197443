"""Where a cluster computes and in what precision: `--device auto|cpu|cuda[:N]`, `--precision auto|fp32|bf16`.

bf16 is autocast only: the weights, their gradients and AdamW's state stay fp32, and so does everything
the exchange sees — the pseudo-gradient is a difference of fp32 weights, and the shards never learn what
precision a cluster trained in. `auto` is bf16 on CUDA (tensor cores; no loss scaling needed, unlike
fp16) and fp32 on the CPU, where bf16 autocast is slower on most processors (`bf16` still asks for it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dilocox.common.config.run import ParallelConfig


class DeviceError(ValueError):
    """A device that this machine does not have."""


@dataclass(frozen=True)
class Compute:
    device: torch.device
    bf16: bool

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    @property
    def backend(self) -> str:
        """The in-site process-group backend: NCCL between GPUs, gloo on the CPU."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


def resolve_compute(parallel: ParallelConfig, local_rank: int = 0) -> Compute:
    """The device of this rank (`cuda` means this rank's local GPU under torchrun) and its precision."""
    wanted = parallel.device
    has_cuda = torch.cuda.is_available()
    if wanted.startswith("cuda") and not has_cuda:
        raise DeviceError(f"--device {wanted}: no CUDA device is available here (torch {torch.__version__}, "
                          f"CUDA build: {torch.version.cuda is not None}); use --device cpu or auto")  # fmt: skip
    if wanted == "cpu" or (wanted == "auto" and not has_cuda):
        device = torch.device("cpu")
    elif wanted.startswith("cuda:"):
        device = torch.device(wanted)
    else:
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"--device {wanted}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    bf16 = parallel.precision == "bf16" or (parallel.precision == "auto" and device.type == "cuda")
    return Compute(device, bf16)
