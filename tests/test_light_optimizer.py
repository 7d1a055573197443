"""Light AdamW state (`--optimizer-state bf16|int8`, worker/train/light_adamw.py): its rules, that it
trains like fp32 AdamW, and that a pp 2 × dp 2 site on real gloo ranks trains with it like one process,
accumulates like the doubled batch, checkpoints and resumes bit for bit, and resumes on another layout."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import pytest
import torch

from dilocox.common.config.run import ParallelConfig, RunConfig
from dilocox.worker.train.inner_trainer import InnerTrainer, make_inner_optimizer
from dilocox.worker.train.light_adamw import INT8_MIN_NUMEL, LightAdamW, int8_block, moment_bytes
from tests.gloo_ranks import as_torchrun_rank, start_ranks
from tests.test_site import (
    BATCH,
    STEPS,
    FixedBatches,
    _full,
    close,
    config,
    data,
    free_port,
    global_batches,
    merged_ranks,
    train_recording,
)

STATES = ("bf16", "int8")


def with_state(cfg: RunConfig, state: str) -> RunConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, optimizer_state=state))


def test_int8_blocks_stay_inside_a_row_and_small_or_flat_tensors_keep_fp32_moments():
    assert int8_block((4096, 8192)) == 256 and int8_block((128256, 8192)) == 256
    assert int8_block((512, 128)) == 128 and int8_block((1024, 192)) == 64  # the largest block dividing a row
    assert int8_block((8192,)) is None and int8_block((100, 100)) is None  # 1-D; a row no block divides
    assert int8_block((31, 128)) is None and 31 * 128 < INT8_MIN_NUMEL  # too small to quantise
    held = 1000 * 8192
    assert moment_bytes((4096, 8192), held, "fp32") == 8 * held and moment_bytes((4096, 8192), held, "bf16") == 4 * held
    assert (
        moment_bytes((4096, 8192), held, "int8") == 2 * held + 8 * held // 256
    )  # codes + a scale per block, two moments
    assert moment_bytes((8192,), 8192, "int8") == 8 * 8192


def test_the_optimizer_is_torchs_adamw_for_fp32_and_light_otherwise():
    params = [torch.nn.Parameter(torch.zeros(64, 128))]
    fp32 = make_inner_optimizer(RunConfig(), params)
    assert type(fp32) is torch.optim.AdamW and not fp32.defaults["fused"]  # the CPU: torch's default path, as before
    light = make_inner_optimizer(with_state(RunConfig(), "int8"), params)
    assert (
        isinstance(light, LightAdamW) and light.moment_state == "int8" and light.defaults["lr"] == RunConfig().inner.lr
    )


def _train(state: str, steps: int = 150) -> tuple[list[float], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    opt = make_inner_optimizer(with_state(RunConfig(), state), model.parameters())
    for group in opt.param_groups:
        group["lr"] = 1e-3
    g = torch.Generator().manual_seed(1)
    target = torch.nn.Linear(128, 128)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 128, generator=g)
        loss = (model(x) - target(x).detach()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model, opt


def test_light_moments_train_like_fp32_adamw():
    """The same regression from the same start: bf16 and 8-bit moments end within 3 % of fp32's loss
    (measured: within 1 %), and far below where they started."""
    reference, _, _ = _train("fp32")
    for state in STATES:
        losses, model, opt = _train(state)
        assert losses[-1] < 0.2 * losses[0]
        assert abs(losses[-1] - reference[-1]) < 0.03 * reference[-1], (state, losses[-1], reference[-1])
        kept = opt.state[model[0].weight]
        if state == "int8":
            assert kept["exp_avg"]["codes"].dtype == torch.uint8 and kept["exp_avg"]["scale"].shape == (512, 1)
            assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float32  # 1-D: fp32 moments
        else:
            assert kept["exp_avg"].dtype == kept["exp_avg_sq"].dtype == torch.bfloat16


def test_state_dict_round_trips_bit_for_bit_and_another_state_is_refused():
    for state in STATES:
        _, model, opt = _train(state, steps=5)
        fresh = make_inner_optimizer(with_state(RunConfig(), state), model.parameters())
        fresh.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own tensors: a load keeps the ones it is given
        g = torch.Generator().manual_seed(5)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        after_first = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, b in zip(model.parameters(), before):
                p.copy_(b)
        fresh.step()
        assert all(torch.equal(a, p.detach()) for a, p in zip(after_first, model.parameters())), state
    with pytest.raises(ValueError, match="saved as another optimizer state"):
        make_inner_optimizer(with_state(RunConfig(), "bf16"), model.parameters()).load_state_dict(opt.state_dict())


# ---------------------------------------------------------------------- a site on gloo ranks


def _site(rank: int, world: int, port: int, out_dir: str) -> None:
    as_torchrun_rank(rank, world, port)
    from dilocox.worker.checkpoint import SiteCheckpoint
    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import SiteTrainer

    mesh = SiteMesh(config(2, 2).parallel, collective_timeout_s=120)
    result: dict = {}
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    try:
        for state in STATES:
            for accum in (1, 2):
                trainer = SiteTrainer(with_state(config(2, 2, accum=accum), state), data(), mesh)
                _, losses = train_recording(trainer, mesh.replica, global_batches(STEPS * accum, BATCH * 2), STEPS)
                result[state, accum] = {
                    "losses": losses,
                    "weights": {n: _full(p) for n, p in trainer.named_parameters()},
                }
            # Checkpoint, restore into a fresh trainer, and train on: the same bits as the first trainer.
            first = SiteTrainer(with_state(config(2, 2), state), data(), mesh)
            first.train_steps(2)
            checkpoint = SiteCheckpoint(
                os.path.join(out_dir, state), "c", rank=mesh.rank, replica=mesh.replica, group=mesh.checkpoint_group
            )
            checkpoint.capture(1, first, None, [])
            checkpoint.commit(1)
            second = SiteTrainer(with_state(config(2, 2), state), data(), mesh)
            assert checkpoint.restore(second, None, []) == 1
            same = all(
                torch.equal(local(a), local(b)) for a, b in zip(first.module.parameters(), second.module.parameters())
            )
            flat_a, flat_b = _flat(first.optimizer.state_dict()["state"]), _flat(second.optimizer.state_dict()["state"])
            same &= flat_a.keys() == flat_b.keys() and all(
                torch.equal(local(flat_a[k]), local(flat_b[k])) for k in flat_a
            )
            same &= [first.train_steps(1)[0] for _ in range(2)] == [second.train_steps(1)[0] for _ in range(2)]
            same &= all(
                torch.equal(local(a), local(b)) for a, b in zip(first.module.parameters(), second.module.parameters())
            )
            result[state, "restored_bit_for_bit"] = same
            checkpoint.close()
            refused = SiteTrainer(config(2, 2), data(), mesh)  # fp32: the checkpoint's moments are kept another way
            try:
                checkpoint.restore(refused, None, [])
                result[state, "refused"] = None
            except ValueError as error:
                result[state, "refused"] = str(error)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        mesh.close()


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _one_process(state: str, accum: int) -> dict:
    trainer = InnerTrainer(with_state(config(1, 1, accum=accum), state), data())
    trainer.sampler = FixedBatches(global_batches(STEPS * accum, BATCH * 2))
    losses = [trainer.train_steps(1)[0] for _ in range(STEPS)]
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in trainer.named_parameters()}}


@pytest.mark.usefixtures("rank_forkserver")
def test_a_pp2_dp2_site_with_light_state_trains_like_one_process_and_resumes_bit_for_bit(tmp_path):
    """pp 2 × dp 2 (FSDP) with bf16 and 8-bit moments: the same losses and weights as one process with
    the same optimizer state on the same global batches (to fp32 tolerance: the blocks lie inside rows,
    so sharding rows over ranks quantises exactly as one process does), with 2 accumulated batches as
    with the doubled batch; a checkpoint restores weights and moments bit for bit and training goes on
    identically; an fp32 site refuses the checkpoint by name; and one process resumes it (DCP reshards
    codes and scales with their rows)."""
    world = 4
    start_ranks(_site, world, (world, free_port(), str(tmp_path)))
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for state in STATES:
        for accum in (1, 2):
            want = _one_process(state, accum)
            # Measured: every tensor within 2.3e-3 after 3 steps (1.9e-2 with 2 batches, as fp32 is: see
            # tests/test_site.py), but the 8-bit embedding's 0.15 — most of its rows see gradients of rounding
            # noise, which AdamW scales to ±lr and 8 bits round either way.
            close(
                merged_ranks(parts, (state, accum), "weights"),
                want["weights"],
                overall=3e-2,
                per_tensor=0.25 if state == "int8" else 3e-2,
            )
            for part in parts:
                got = part[state, accum]["losses"]
                assert all(abs(a - b) < tol * b for a, b, tol in zip(got, want["losses"], [1e-5, 1e-4, 3e-3])), (
                    state,
                    got,
                    want,
                )
        assert all(part[state, "restored_bit_for_bit"] for part in parts), state
        assert all(
            f"keeps AdamW's moments as {state}" in part[state, "refused"]
            and "--optimizer-state" in part[state, "refused"]
            for part in parts
        )

    from dilocox.worker.checkpoint import SiteCheckpoint
    from dilocox.worker.checkpoint_manifest import COMMITTED, seal_name

    # Each rank sealed the files it wrote (its DCP part; rank 0 also the metadata); rank 0 listed them all.
    folder = tmp_path / "int8" / "c" / "round-000001"
    committed = json.loads((folder / COMMITTED).read_text())
    assert committed["seals"] == [seal_name(r) for r in range(world)]
    sealed = {r: json.loads((folder / seal_name(r)).read_text())["files"] for r in range(world)}
    assert all(any(name.startswith(f"__{r}_") for name in sealed[r]) for r in range(world))
    assert sorted(n for files in sealed.values() for n in files) == sorted(committed["files"])

    for state in STATES:  # another layout: one process takes the pp 2 × dp 2 checkpoint
        trainer = InnerTrainer(with_state(config(1, 1), state), data())
        names = [n for n, _ in trainer.named_parameters()]
        assert SiteCheckpoint(tmp_path / state, "c").restore(trainer, None, names) == 1
        assert trainer.step == 2
        kept = trainer.optimizer.state
        weights = [p for n, p in trainer.named_parameters() if p.ndim == 2 and int8_block(tuple(p.shape))]
        assert weights and all(kept[p]["step"] == 2 for p in weights)
        if state == "int8":
            w = weights[0]
            codes, scale = kept[w]["exp_avg"]["codes"], kept[w]["exp_avg"]["scale"]
            assert codes.shape == w.shape and scale.shape == (
                w.shape[0],
                math.prod(w.shape[1:]) // int8_block(tuple(w.shape)),
            )
            assert codes.any() and scale.gt(0).all()
        trainer.train_steps(1)  # trains on from the resharded state
        assert trainer.step == 3


def test_a_site_refuses_light_state_without_torchao(monkeypatch):
    """Where torchao is missing, the worker says which extra to install before anything is built."""
    import sys

    from dilocox.worker.train import light_adamw

    light_adamw._torchao.cache_clear()
    monkeypatch.setitem(sys.modules, "torchao.optim.adam", None)
    try:
        with pytest.raises(light_adamw.OptimizerStateError, match=r"pip install 'dilocox\[site\]'"):
            light_adamw.require_torchao()
        with pytest.raises(ValueError, match="optimizer_state must be fp32, bf16 or int8"):
            ParallelConfig(optimizer_state="int4")
    finally:
        light_adamw._torchao.cache_clear()
