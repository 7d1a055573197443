"""`--compile blocks`: each transformer block compiled in place by torch.compile (inductor).

The site's numerics with compiled blocks are held against one eager process on the same global batches, at
pp 2 × dp 2 on gloo (pipelining and FSDP2 around compiled blocks), with the tolerances of the eager site's
own test (tests/test_site.py) widened only where inductor's fused kernels reorder fp32 sums; the setting is
refused up front where inductor cannot compile."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from dilocox.common.config.parallel import ParallelConfig
from dilocox.worker.train import block_compile
from tests.gloo_ranks import as_torchrun_rank, start_ranks
from tests.test_site import BATCH, STEPS, close, config, data, free_port, global_batches, merged_ranks, reference

PP, DP = 2, 2


def compiled(cfg):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, compile="blocks"))


def _compiled_site(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank of a pp 2 × dp 2 site with compiled blocks: the first step's gradients, every step's loss, the
    weights after the steps, and what the compiler made of the blocks."""
    as_torchrun_rank(rank, world, port)
    from torch._dynamo.utils import counters

    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import SiteTrainer
    from tests.test_site import _full, train_recording

    cfg = compiled(config(PP, DP))
    mesh = SiteMesh(cfg.parallel, collective_timeout_s=600)  # the first step waits for the compiler
    try:
        trainer = SiteTrainer(cfg, data(), mesh)
        grads, losses = train_recording(trainer, mesh.replica, global_batches(STEPS, BATCH * DP), STEPS)
        result = {
            "grads": grads,
            "losses": losses,
            "weights": {n: _full(p) for n, p in trainer.named_parameters()},
            "graphs": counters["stats"]["unique_graphs"],
            "compiled_blocks": sum(
                getattr(m, "_compiled_call_impl", None) is not None for m in trainer.module.modules()
            ),
        }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        mesh.close()


@pytest.mark.usefixtures("rank_forkserver")
def test_a_compiled_pp2_dp2_site_trains_like_one_eager_process(tmp_path):
    """Measured against the eager reference: the first step's gradients 2e-7 overall (as the eager site's:
    the order of the sums), the losses to 1e-6 relative, the weights after 3 steps to ~3e-3 (AdamW's first
    steps, as in tests/test_site.py). Each rank compiles one graph for all its blocks."""
    world = PP * DP
    start_ranks(_compiled_site, world, (world, free_port(), str(tmp_path)))
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    want = reference(1, DP)
    close(merged_ranks(parts, "grads"), want["grads"], overall=1e-5, per_tensor=1e-4)
    close(merged_ranks(parts, "weights"), want["weights"], overall=1e-2, per_tensor=2e-2)
    for part in parts:
        tolerance = [1e-5, 1e-5, 2e-3]  # relative, as the eager site's
        assert all(abs(a - b) < t * b for a, b, t in zip(part["losses"], want["losses"], tolerance)), part["losses"]
        assert part["compiled_blocks"] >= 1 and part["graphs"] >= 1


def test_compile_is_refused_up_front_without_a_cpu_compiler(monkeypatch):
    monkeypatch.setattr(block_compile.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(block_compile.CompileUnavailable, match="needs a C\\+\\+ compiler"):
        block_compile.compile_blocks(torch.nn.Module(), torch.device("cpu"))


def test_compile_setting_is_checked():
    assert ParallelConfig().compile == "off"
    with pytest.raises(ValueError, match="compile must be one of off, blocks"):
        ParallelConfig(compile="max-autotune")
