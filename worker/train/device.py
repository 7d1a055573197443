"""Where a rank computes and in what precision: `--device auto|cpu|cuda[:N]`, `--precision auto|fp32|bf16`.

Weights, their gradients and AdamW's state stay fp32 whatever the precision, and so does everything the
exchange sees — the pseudo-gradient is a difference of fp32 weights, and the shards never learn what
precision a cluster trained in. bf16 is how the forward and backward compute: autocast for a model on
one rank, FSDP2's mixed-precision policy (bf16 parameters in compute, fp32 gradient reduction) for a
sharded stage (worker/site/parallelize.py).

`auto` is bf16 on GPUs that compute in it natively (compute capability ≥ 8: A100, H100, …; no loss
scaling needed, unlike fp16) and fp32 elsewhere: on the CPU, where bf16 autocast is slower on most
processors, and on older GPUs (V100, T4), where torch only emulates bf16. Asking for `bf16` on those
still gets it, with a warning.

Under torchrun every rank takes the GPU of its LOCAL_RANK. Two ranks of a site cannot share a GPU (NCCL
refuses a communicator with a duplicate device), so a node with fewer GPUs than ranks is refused here,
with the numbers, instead of failing inside NCCL's initialisation.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import structlog
import torch

from dilocox.common.config.run import ParallelConfig

log = structlog.get_logger()

NATIVE_BF16_CAPABILITY = 8  # Ampere and newer


class DeviceError(ValueError):
    """A device that this machine does not have, or a layout its GPUs cannot hold."""


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

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def synchronize(self) -> None:
        """Wait for the device's queued work (timings, host reads of device results)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def prefer_expandable_segments() -> None:
    """Ask torch's caching allocator for expandable segments (a segment grows in place instead of a new
    one being cut for a larger block), as torchtitan does: fragmentation of a few percent instead of ~6 %,
    what the memory plan allows for (`FRAGMENTATION`). Set in the environment before CUDA is first used,
    and inherited by the ranks torchrun starts; an operator's own setting is kept, and said."""
    current = os.environ.get(ALLOC_CONF)
    if current is None:
        os.environ[ALLOC_CONF] = "expandable_segments:True"
    elif "expandable_segments:True" not in current:
        log.info(
            "allocator_setting_kept",
            setting=f"{ALLOC_CONF}={current}",
            note="without expandable_segments:True fragmentation may exceed the memory plan's 3 % allowance",
        )


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes in bf16 natively (CUDA compute capability ≥ 8)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= NATIVE_BF16_CAPABILITY


def resolve_compute(parallel: ParallelConfig, local_rank: int = 0, local_world_size: int = 1) -> Compute:
    """The device of this rank (`cuda` means this rank's local GPU under torchrun) and its precision.

    `local_rank`/`local_world_size`: this rank's place among the site's ranks on this node (torchrun's
    LOCAL_RANK and LOCAL_WORLD_SIZE)."""
    wanted = parallel.device
    has_cuda = torch.cuda.is_available()
    if wanted.startswith("cuda") and not has_cuda:
        raise DeviceError(
            f"--device {wanted}: no CUDA device is available here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda is not None}); use --device cpu or auto"
        )
    if wanted == "cpu" or (wanted == "auto" and not has_cuda):
        device = torch.device("cpu")
    elif wanted.startswith("cuda:"):
        if local_world_size > 1:
            raise DeviceError(
                f"--device {wanted} would put all {local_world_size} ranks on this node on one GPU; "
                "use --device cuda: each rank takes the GPU of its LOCAL_RANK"
            )
        device = torch.device(wanted)
    else:
        gpus = torch.cuda.device_count()
        if local_world_size > gpus:
            raise DeviceError(
                f"this node runs {local_world_size} ranks of the site but has {gpus} GPU(s); two ranks cannot share "
                f"one GPU (NCCL). Start at most {gpus} ranks per node (torchrun --nproc-per-node), spread the site "
                "over more nodes, or use a smaller --pp × --dp"
            )
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"--device {wanted}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parallel.precision == "auto":
        bf16 = native_bf16(device)
    else:
        bf16 = parallel.precision == "bf16"
        if bf16 and device.type == "cuda" and not native_bf16(device):
            major, minor = torch.cuda.get_device_capability(device)
            log.warning(
                "bf16_emulated",
                device=str(device),
                capability=f"{major}.{minor}",
                reason="this GPU has no native bf16 (compute capability < 8): torch emulates it, slowly; "
                "--precision fp32 (or auto) is faster here",
            )
    return Compute(device, bf16)
