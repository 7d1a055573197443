"""Pipelining whose FSDP2 blocks do not stay gathered: `--pipeline-reshard microbatch`.

torch 2.13's `PipelineStage` drives an FSDP2 stage for the fewest collectives: before every microbatch's
backward it turns off FSDP's reshard-after-backward and gradient sync, and reduces once after the last
microbatch (`perform_reduce_grad`). So every block of the stage stays gathered, and its gradients stay
unsharded in fp32, from its first forward to the end of the step — about 6 B per *stage* parameter on
every GPU whatever the FSDP degree (docs/decisions.md). Past some size that alone does not fit.

This stage leaves FSDP2 at its own defaults instead: each block reshards after its backward and
reduce-scatters that microbatch's gradients, which accumulate into the sharded `.grad` — the memory of
unpipelined FSDP, for microbatches × the all-gathers and reduce-scatters. The end-of-step
`perform_reduce_grad` stays: FSDP2's `post_backward` is idempotent and finds nothing left to reduce.
(Blocks reshard after forward too: worker/site/parallelize.py, `keep_gathered=False`.)
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward  # the base class's own call (torch 2.13)


class MicrobatchReshardStage(PipelineStage):
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):  # noqa: ANN001, ANN201
        """A full backward of one microbatch with FSDP2 at its defaults: the same call the base class
        makes for a module without data parallelism (GPipe and 1F1B only run full backwards)."""
        if not isinstance(self.submod, FSDPModule) or backward_type != "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None
