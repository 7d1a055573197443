"""`--compile blocks`: each transformer block's forward through torch.compile, as torchtitan compiles its
blocks one by one.

Why per block and in place: the blocks of a model are alike, so inductor compiles one graph and reuses it
for every block (a whole-model graph would be compiled at full size, and broken at every FSDP2 hook
anyway). `nn.Module.compile` swaps the block's call for a compiled one without wrapping it in another
module, so parameter names — what the shards and the checkpoints key on — stay the same, FSDP2 still
makes each block its own unit, and a block whose forward activation checkpointing wrapped
(`checkpoint_blocks`) is compiled with the recomputation inside. Applied after activation checkpointing
and before FSDP2, in that order, as torchtitan does. FSDP2's own hooks stay eager (dynamo skips them).

On the CPU inductor writes C++ and needs a compiler; without one the setting is refused before the model
is built rather than at the first step.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from dilocox.worker.site.parallelize import transformer_blocks


class CompileUnavailable(RuntimeError):
    """`--compile blocks` asked where torch.compile cannot run."""


def check_compile_available(device: torch.device) -> None:
    """Refuse `--compile blocks` where inductor cannot compile for `device`, saying what is missing."""
    if device.type == "cpu" and not any(
        shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c
    ):
        raise CompileUnavailable(
            "--compile blocks on the CPU needs a C++ compiler for inductor (g++ or clang++, or $CXX); "
            "install one or run with --compile off"
        )


def compile_blocks(module: nn.Module, device: torch.device) -> int:
    """Compile every transformer block of `module` in place for `device` (compiled lazily, at its first
    call); returns how many blocks. Refuses first where inductor cannot compile there."""
    check_compile_available(device)
    blocks = transformer_blocks(module)
    for block in blocks:
        block.compile()
    return len(blocks)
