"""A site builds its model sharded (meta → FSDP2 → each rank its own rows) and starts from exactly the
single process's θ₀: per-unit seeded init (worker/models/materialize.py), checked on real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dilocox.common.config.run import ModelConfig, ParallelConfig, RunConfig
from dilocox.worker.models.build import build_model
from dilocox.worker.models.materialize import (
    MaterializeError,
    initial_values,
    materialize,
    meta_skeleton,
    parameters_on_meta,
    unit_seed,
)
from tests.gloo_ranks import as_torchrun_rank, start_ranks
from tests.ports import free_port

VOCAB = 300


def config(model: str, pp: int, dp: int, replicate: int = 1) -> RunConfig:
    return RunConfig(
        seed=7,
        model=ModelConfig(model=model, block_size=16),
        parallel=ParallelConfig(pp=pp, dp=dp, dp_replicate=replicate, microbatches=2, device="cpu"),
    )


def _rank(rank: int, world: int, port: int, model: str, layout: tuple[int, int, int], out_dir: str) -> None:
    as_torchrun_rank(rank, world, port)
    from torch.distributed.tensor import DTensor

    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import build_site_module

    cfg = config(model, *layout)
    mesh = SiteMesh(cfg.parallel, collective_timeout_s=120)
    try:
        module = build_site_module(cfg, VOCAB, mesh)
        whole, local_elements, full_elements = {}, 0, 0
        for name, p in module.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            local_elements += local.numel()
            full_elements += p.numel()
            whole[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        buffers = {n: b.clone() for n, b in module.named_buffers()}
        torch.save(
            {"whole": whole, "local": local_elements, "full": full_elements, "buffers": buffers},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        mesh.close()


LAYOUTS = [("llama-tiny", (2, 2, 1)), ("gpt", (1, 2, 2)), ("gpt", (2, 2, 1)), ("llama-tiny", (1, 2, 1))]


@pytest.mark.parametrize(
    "model,layout", LAYOUTS, ids=["llama-pp2-fsdp2", "gpt-hsdp2x2", "gpt-pp2-fsdp2", "llama-fsdp2"]
)
@pytest.mark.usefixtures("rank_forkserver")
def test_every_layout_starts_from_the_single_process_bits(model, layout, tmp_path):
    """Each rank materialises only its rows, and the gathered stages equal `build_model` bit for bit;
    buffers (rotary frequencies) too."""
    pp, dp, replicate = layout
    world = pp * dp
    start_ranks(_rank, world, (world, free_port(), model, layout, str(tmp_path)))
    reference = build_model(config(model, 1, 1).model, VOCAB, 7)
    want = {n: p.detach() for n, p in reference.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for r in range(world):
        part = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for name, value in part["whole"].items():
            assert torch.equal(value, want[name]), f"rank {r}: {name} differs from the single process"
            got[name] = value
        for name, value in part["buffers"].items():
            assert torch.equal(value, dict(reference.named_buffers())[name]), name
        dp_shard = dp // replicate
        if dp_shard > 1:  # FSDP: about 1/dp_shard of the stage's elements, never the whole stage
            assert part["local"] <= part["full"] // dp_shard + 4096
    assert got.keys() == want.keys()


def test_a_unit_depends_on_its_name_and_the_seed_only():
    """The same module drawn under two names (or two seeds) differs; under the same name it repeats;
    a sibling's presence draws nothing from the unit's generator (meta ops consume no numbers)."""
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    skeleton = meta_skeleton(model)
    reset = lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None  # noqa: E731
    a = initial_values(skeleton, "0", reset, seed=1)["weight"]
    assert torch.equal(a, initial_values(skeleton, "0", reset, seed=1)["weight"])
    assert not torch.equal(a, initial_values(skeleton, "1", reset, seed=1)["weight"])
    assert not torch.equal(a, initial_values(skeleton, "0", reset, seed=2)["weight"])
    assert unit_seed(1, "0") != unit_seed(1, "1")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(1, "0"))
        alone = nn.Linear(8, 8)  # its own reset_parameters, drawn first from the same seed
    assert torch.equal(a, alone.weight.detach())


def test_parameters_go_to_meta_and_buffers_keep_their_values():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("freq", torch.arange(4.0) * 2, persistent=False)

    with parameters_on_meta():
        m = WithBuffer()
    assert m.proj.weight.is_meta and not m.freq.is_meta
    materialize(m, "cpu", seed=3)
    assert torch.equal(m.freq, torch.arange(4.0) * 2)
    assert not m.proj.weight.is_meta and torch.isfinite(m.proj.weight).all()


def test_an_init_that_leaves_a_parameter_unset_or_a_meta_buffer_is_refused_by_name():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))  # no reset_parameters: the default init sets nothing

    with parameters_on_meta():
        bare = Bare()
    with pytest.raises(MaterializeError, match="leaves scale"):
        materialize(bare, "cpu", seed=0)
    with torch.device("meta"):
        full_meta = nn.Module()
        full_meta.register_buffer("mask", torch.ones(2))
        full_meta.lin = nn.Linear(2, 2)
    with pytest.raises(MaterializeError, match="buffer mask is on the meta device"):
        materialize(full_meta, "cpu", seed=0)
