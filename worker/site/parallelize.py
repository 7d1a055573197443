"""Data parallelism inside a site: torch's FSDP2 (`fully_shard`) on a stage, as torchtitan applies it.

Each transformer block becomes its own FSDP unit (its parameters gathered just before it computes and
freed after, so a rank holds one block unsharded at a time), then the stage's root takes what is left
(embeddings, final norm, head). The mesh decides the flavour: 1-D → FSDP (every parameter's rows split
over the stage's dp ranks), 2-D (dp_replicate, dp_shard) → HSDP, and dp_shard = 1 → plain replication
with FSDP2's all-reduce of gradients. Gradients are averaged over the dp ranks by FSDP's reduce-scatter
(or all-reduce), bucketed per unit and overlapped with the backward — nothing of it is written here.

In bf16 FSDP's mixed-precision policy replaces autocast: parameters are gathered and computed in bf16,
gradients reduced in fp32, and the sharded parameters and AdamW's state stay fp32. Outputs stay bf16, as
in torchtitan: every unit casts what comes in to bf16 anyway, so a block's output cast to fp32 and back
changed nothing but cost a copy — and where the root's own modules computed on it (the final norm and
head after the last block) it broke the run (`F.linear` of fp32 activations with bf16 weights). So
activations cross the pipeline in bf16 (half the bytes between nodes; their gradients too) and the last
stage's logits are bf16: the loss upcasts them a piece at a time (worker/models/chunked_loss.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

BLOCK_LIST_NAMES = ("blocks", "layers", "h")  # the built-in GPT, Llama-family HF models, GPT-2-style models


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model or stage: the items of a ModuleList/ModuleDict named like a block list."""
    blocks: list[nn.Module] = []
    for name, child in module.named_modules():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and name.rsplit(".", 1)[-1] in BLOCK_LIST_NAMES:
            blocks.extend(child.values() if isinstance(child, nn.ModuleDict) else child)
    return blocks


CHECKPOINT_EVERY = {"full": 1, "selective": 2}  # --activation-checkpoint: which blocks (every k-th, from the first)


def checkpoint_blocks(module: nn.Module, mode: str = "full") -> int:
    """Activation checkpointing (`--activation-checkpoint full|selective`): every transformer block of
    `module` (selective: every other one, blocks 0, 2, 4, … of it) runs its forward under
    `torch.utils.checkpoint` (non-reentrant), so autograd keeps only the block's input and recomputes the
    rest in the backward. Applied before FSDP, as torchtitan does; the block's forward is wrapped in place
    rather than the block in a wrapper module, so parameter names — what the shards see — stay the same.
    Returns the number of blocks wrapped."""
    blocks = checkpointed_blocks(transformer_blocks(module), mode)
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(blocks)


def checkpointed_blocks(blocks: list, mode: str) -> list:
    """The entries of `blocks` (modules, or a plan's sizes of them) that `mode` checkpoints."""
    every = CHECKPOINT_EVERY.get(mode)
    return [b for i, b in enumerate(blocks) if every and i % every == 0]


def _checkpointed(forward, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def shard_stage(module: nn.Module, mesh: DeviceMesh, bf16: bool, keep_gathered: bool = False) -> nn.Module:
    """Apply FSDP2 to `module` in place (blocks first, then the root); returns it.

    `keep_gathered` (`--pipeline-reshard step` under pipelining): the stage runs several micro-batches per
    step, so its blocks stay gathered from their first forward to the end of the step's backward instead
    of being gathered again for every micro-batch (torchtitan's default with pipelining: one gather per
    block and step, for the memory of the stage's gathered parameters during the step). Otherwise each
    block reshards after its forward (`--pipeline-reshard microbatch`: worker/site/pipeline_fsdp.py)."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    blocks = transformer_blocks(module)
    for i, block in enumerate(blocks):
        # The last block is gathered again at once by the backward: keep it (torchtitan does the same).
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep_gathered and i < len(blocks) - 1)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    return module


def local_part(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter (or gradient) this rank holds: its FSDP shard's rows, or all of it."""
    return param.to_local() if isinstance(param, DTensor) else param


def reshard_all(module: nn.Module) -> None:
    """Put every FSDP unit of `module` back in its sharded state. A forward without a backward (eval)
    leaves the root's parameters gathered — and registered as plain, whole tensors — until the next
    forward; the exchange must see each rank's shard."""
    for child in module.modules():
        if isinstance(child, FSDPModule):
            child.reshard()
