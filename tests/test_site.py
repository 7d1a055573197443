"""A site on real torch.distributed process groups (gloo on CPU): FSDP2 × pipelining against one process,
gradient accumulation, the reshard between FSDP's layout and the exchange's, and DCP checkpoints."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig, RunConfig
from dilocox.common.wire.assignment import assign_slices
from dilocox.common.wire.compression import CompressionConfig, TensorCompressor
from dilocox.worker.data.corpus import load_corpus
from dilocox.worker.data.token_data import EVAL_FRACTION, TokenData
from dilocox.worker.models.build import build_model
from dilocox.worker.models.contract import lm_loss
from dilocox.worker.train.inner_trainer import InnerTrainer
from tests.gloo_ranks import as_torchrun_rank, start_ranks

STEPS = 3
BATCH = 4  # per replica and accumulated batch
BLOCK = 16


def config(pp: int, dp: int, replicate: int = 1, accum: int = 1, clip: float = 1.0, reshard: str = "auto") -> RunConfig:
    return RunConfig(
        rounds=1,
        model=ModelConfig(model="llama-tiny", block_size=BLOCK),
        inner=InnerConfig(steps=STEPS, batch_size=BATCH, warmup_steps=1, grad_accum=accum, grad_clip=clip),
        parallel=ParallelConfig(
            pp=pp, dp=dp, dp_replicate=replicate, microbatches=2, device="cpu", pipeline_reshard=reshard
        ),
    )


def data() -> TokenData:
    return TokenData.from_bytes(load_corpus(None), EVAL_FRACTION)


def global_batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` fixed batches of `size` windows from the corpus (the same in every process)."""
    tokens = data().train
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(tokens) - BLOCK - 1, (size,), generator=g)
        rows = torch.stack([torch.as_tensor(tokens[int(s) : int(s) + BLOCK + 1], dtype=torch.long) for s in starts])
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


class FixedBatches:
    """A sampler that hands out given batches in order: the same samples for a site and for one process."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches, self.i = batches, 0
        self.tokens_per_batch = batches[0][0].numel()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.i]
        self.i += 1
        return batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _site(rank: int, world: int, port: int, layout: tuple, out_dir: str) -> None:
    """One rank: train on fixed batches (its replica's part of each global batch), record gradients of
    the first step, losses and weights; reshard round trip; checkpoint, restore, compare."""
    as_torchrun_rank(rank, world, port)
    from dilocox.worker.checkpoint import SiteCheckpoint
    from dilocox.worker.models.build import model_param_specs
    from dilocox.worker.site.access import SiteAccess
    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import SiteTrainer

    pp, dp, replicate, *mode = layout
    reshard = mode[0] if mode else "auto"
    mesh = SiteMesh(config(pp, dp, replicate).parallel, collective_timeout_s=120)
    result: dict = {}
    try:
        for accum in (1, 2) if pp > 1 else (1,):
            cfg = config(pp, dp, replicate, accum=accum, reshard=reshard)
            trainer = SiteTrainer(cfg, data(), mesh)
            first_grads, losses = train_recording(
                trainer, mesh.replica, global_batches(STEPS * accum, BATCH * dp), STEPS
            )
            result[f"accum{accum}"] = {
                "grads": first_grads,
                "losses": losses,
                "weights": {n: _full(p) for n, p in trainer.named_parameters()},
            }
        result["eval"] = trainer.evaluate()

        # The exchange's view: each parameter read whole by its owner, written back from it.
        specs = model_param_specs(cfg.model, trainer.vocab_size)
        access = SiteAccess(mesh, trainer.named_parameters, specs, batch_elements=5000)  # several batches
        owned = {n: torch.empty(access.shapes[n]) for n in access.names}
        access.read(owned)
        result["read"] = {n: t.clone() for n, t in owned.items()}
        access.write({n: t + 1.0 for n, t in owned.items()})
        result["after_write"] = {n: _full(p) for n, p in trainer.named_parameters()}
        result["held"], result["owned"] = access.params_held, sum(t.numel() for t in owned.values())

        # Checkpoint (real samplers, an uplink compressor with state for the owned slices), then restore
        # into a fresh trainer of the same layout: bit for bit.
        first = SiteTrainer(config(pp, dp, replicate, reshard=reshard), data(), mesh)
        first.train_steps(2)
        compressor = TensorCompressor(CompressionConfig(), seed=1)
        g = torch.Generator().manual_seed(100 + rank)
        for s in assign_slices(specs, 2):
            if s.name in access.names:
                compressor.compress(s.key, torch.randn(s.slice_shape, generator=g))
        checkpoint = SiteCheckpoint(
            os.path.join(out_dir, "ckpt"), "c", rank=mesh.rank, replica=mesh.replica, group=mesh.checkpoint_group
        )
        checkpoint.capture(1, first, compressor, access.names)
        result["staged_bytes"] = checkpoint.staged_bytes
        checkpoint.commit(1)
        second = SiteTrainer(config(pp, dp, replicate, reshard=reshard), data(), mesh)
        restored = TensorCompressor(CompressionConfig(), seed=1)
        assert checkpoint.restore(second, restored, access.names) == 1
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        same = all(
            torch.equal(local(a), local(b)) for a, b in zip(first.module.parameters(), second.module.parameters())
        )
        opt_a, opt_b = first.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
        same &= all(torch.equal(local(opt_a[k][f]), local(opt_b[k][f])) for k in opt_a for f in opt_a[k])
        groups = lambda opt: [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]  # noqa: E731
        same &= groups(first.optimizer) == groups(second.optimizer)
        same &= first.sampler.state_dict()["batches_drawn"] == second.sampler.state_dict()["batches_drawn"] == 2
        same &= torch.equal(first.sampler.state_dict()["generator"], second.sampler.state_dict()["generator"])
        same &= second.step == first.step == 2
        same &= all(torch.equal(compressor.state[k].error, restored.state[k].error) for k in compressor.state)
        same &= set(compressor.state) == set(restored.state) and len(compressor.state) > 0
        result["restored_bit_for_bit"] = same
        result["checkpoint_weights"] = {n: _full(p) for n, p in first.named_parameters()}
        result["compressor_keys"] = sorted(str(k) for k in compressor.state)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        mesh.close()


def train_recording(
    trainer, replica: int, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int
) -> tuple[dict, list[float]]:  # noqa: ANN001
    """Train `steps` inner steps on this replica's part of each global batch; returns the first step's
    gradients (whole, as one process holds them) and every step's loss."""
    part = slice(replica * BATCH, (replica + 1) * BATCH)
    trainer.sampler = FixedBatches([(x[part], y[part]) for x, y in batches])
    grads: list[dict] = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        if not grads:
            grads.append({n: _full(p.grad) for n, p in trainer.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    losses = [trainer.train_steps(1)[0] for _ in range(steps)]
    return grads[0], losses


def reference(accum: int, dp: int) -> dict:
    """One process on the same global batches: gradients of the first step, losses, final weights."""
    cfg = config(1, 1, accum=accum)
    batches = global_batches(STEPS * accum, BATCH * dp)
    model = build_model(cfg.model, data().vocab_size, cfg.seed)
    x, y = (torch.cat(parts) for parts in zip(*batches[:accum]))
    lm_loss(model, x, y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    trainer = InnerTrainer(cfg, data())
    trainer.sampler = FixedBatches(batches)  # it draws `accum` of them per step
    losses = [trainer.train_steps(1)[0] for _ in range(STEPS)]
    return {
        "grads": grads,
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in trainer.named_parameters()},
        "eval": trainer.evaluate(),
    }


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], overall: float, per_tensor: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        diff = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12))
        assert diff < per_tensor, (name, diff)
    g = torch.cat([got[n].flatten() for n in want])
    w = torch.cat([want[n].flatten() for n in want])
    assert float((g - w).norm() / w.norm()) < overall


def merged_ranks(parts: list[dict], key: str, sub: str | None = None) -> dict:
    out: dict = {}
    for part in parts:
        value = part[key] if sub is None else part[key][sub]
        out.update(value)
    return out


@pytest.mark.parametrize(
    "layout",
    [(1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 1, "microbatch")],
    ids=["fsdp-dp2", "pp2-fsdp-dp2", "replicate-dp2", "pp2-fsdp-dp2-reshard-per-microbatch"],
)
@pytest.mark.usefixtures("rank_forkserver")
def test_site_trains_like_one_process_on_the_same_global_batch(layout, tmp_path):
    """FSDP2 dp=2, pp=2 × dp=2 and plain replication train as one process on the same global batch, to
    fp32 tolerance: the first step's gradients to 1e-6 relative (measured ~2e-7: only the order of the
    sums differs), the losses of the first 2 steps to 1e-5 relative (measured ≤ 4e-7) and the third to
    2e-3 (measured ≤ 7e-4). The weights agree to 1e-2 after 3 steps (measured ~3e-3): AdamW's first steps move every
    element by about ±lr whatever its gradient's size,
    so where a gradient is rounding noise around zero the two runs step apart, and that grows — the
    same happens between one process and itself with a different micro-batching. With pp=2, gradient
    accumulation over 2 batches gives the gradient of the doubled batch."""
    pp, dp, replicate = layout[:3]
    world = pp * dp
    start_ranks(_site, world, (world, free_port(), layout, str(tmp_path)))
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    accums = (1, 2) if pp > 1 else (1,)
    for accum in accums:
        want = reference(accum, dp)
        got_grads = merged_ranks(parts, f"accum{accum}", "grads")
        close(got_grads, want["grads"], overall=1e-6, per_tensor=1e-5)
        close(merged_ranks(parts, f"accum{accum}", "weights"), want["weights"], overall=1e-2, per_tensor=2e-2)
        for part in parts:
            got = part[f"accum{accum}"]["losses"]
            tolerance = [1e-5, 1e-5, 2e-3]  # relative; the third step's loss sees AdamW's divergence (above)
            assert all(abs(a - b) < tol * b for a, b, tol in zip(got, want["losses"], tolerance)), (got, want["losses"])
    assert len({round(p["eval"], 6) for p in parts}) == 1  # every rank reports the site's one eval loss
    assert abs(parts[0]["eval"] - want["eval"]) < 1e-3 * want["eval"]  # the same windows, the model as close as above

    # Reshard: every parameter read whole by exactly one owner, equal to the weights; written back +1
    # everywhere; each rank owns about its share.
    weights = merged_ranks(parts, f"accum{accums[-1]}", "weights")
    read = {}
    for part in parts:
        assert read.keys().isdisjoint(part["read"])
        read.update(part["read"])
    assert read.keys() == weights.keys()
    for name, tensor in read.items():
        assert torch.equal(tensor, weights[name]), name
        for part in parts:
            if name in part["after_write"]:
                assert torch.equal(part["after_write"][name], tensor + 1.0), name
    stage_params = {s: sum(part["owned"] for i, part in enumerate(parts) if i // dp == s) for s in range(pp)}
    for i, part in enumerate(parts):
        assert part["owned"] < stage_params[i // dp]  # a share of its stage, never all of it
        if replicate == 1:
            assert part["held"] <= 0.55 * stage_params[i // dp]  # FSDP: a rank holds its 1/dp of the stage

    assert all(part["restored_bit_for_bit"] for part in parts)
    if replicate > 1:  # replicated weights and AdamW state are staged by replica 0 alone; every replica restores them
        assert parts[1]["staged_bytes"] < 0.1 * parts[0]["staged_bytes"], [p["staged_bytes"] for p in parts]
    if layout == (1, 2, 1):
        resume_on_one_process(parts, tmp_path)


def resume_on_one_process(parts: list[dict], tmp_path) -> None:
    """The pp=1 × dp=2 FSDP checkpoint loads into one process: DCP reshards the weights and AdamW's state,
    and the compressor state follows each parameter to its new owner; the data is split another way now,
    so its position starts over (logged)."""
    from dilocox.worker.checkpoint import SiteCheckpoint

    trainer = InnerTrainer(config(1, 1), data())
    compressor = TensorCompressor(CompressionConfig(), seed=1)
    names = [n for n, _ in trainer.named_parameters()]
    assert SiteCheckpoint(tmp_path / "ckpt", "c").restore(trainer, compressor, names) == 1
    for name, p in trainer.named_parameters():
        assert torch.equal(p.detach(), parts[0]["checkpoint_weights"][name]), name
    assert sorted(str(k) for k in compressor.state) == sorted(parts[0]["compressor_keys"] + parts[1]["compressor_keys"])
    assert trainer.step == 2 and trainer.sampler.state_dict()["batches_drawn"] == 0
    assert set(trainer.optimizer.state_dict()["state"]) == set(range(len(names)))


# ---------------------------------------------------------------------- layouts the hardware cannot run


class _GPUs:
    """Stands in for the CUDA devices of a machine (count and compute capability) in `torch.cuda`'s
    query functions, so the assignment rules can be checked where no GPU is."""

    def __init__(self, monkeypatch, count: int, capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_layouts_that_cannot_run_are_refused_with_the_reason():
    with pytest.raises(
        ValueError, match="schedule 1f1b needs at least as many microbatches as stages: --pp 8 with --microbatches 4"
    ):
        ParallelConfig(pp=8, dp=1)  # the default 4 micro-batches
    ParallelConfig(pp=8, microbatches=8)
    ParallelConfig(pp=8, schedule="gpipe")  # GPipe runs with fewer micro-batches than stages
    with pytest.raises(ValueError, match=r"--device cuda:1 would put all 4 ranks of this site on one GPU"):
        ParallelConfig(pp=2, dp=2, device="cuda:1")
    with pytest.raises(ValueError, match="dp_replicate must be ≥ 1 and divide dp"):
        ParallelConfig(dp=4, dp_replicate=3)


def test_device_assignment_under_torchrun(monkeypatch):
    from dilocox.worker.train.device import DeviceError, resolve_compute

    _GPUs(monkeypatch, count=2, capability=(9, 0))
    compute = resolve_compute(ParallelConfig(dp=2, device="cuda"), local_rank=1, local_world_size=2)
    assert compute.device == torch.device("cuda", 1) and compute.bf16  # its LOCAL_RANK's GPU; auto → bf16 natively
    with pytest.raises(
        DeviceError, match=r"this node runs 4 ranks of the site but has 2 GPU\(s\); two ranks cannot share one GPU"
    ):
        resolve_compute(ParallelConfig(dp=4, device="cuda"), local_rank=0, local_world_size=4)
    with pytest.raises(DeviceError, match=r"--device cuda:0 would put all 2 ranks on this node on one GPU"):
        resolve_compute(ParallelConfig(device="cuda:0"), local_rank=0, local_world_size=2)


def test_auto_precision_is_fp32_where_bf16_is_only_emulated(monkeypatch):
    from dilocox.worker.train.device import resolve_compute

    _GPUs(monkeypatch, count=1, capability=(7, 0))  # a V100: bf16 emulated
    assert not resolve_compute(ParallelConfig(device="cuda")).bf16
    assert resolve_compute(ParallelConfig(device="cuda", precision="bf16")).bf16  # asked for: given, with a warning
    _GPUs(monkeypatch, count=1, capability=(8, 0))
    assert resolve_compute(ParallelConfig(device="cuda")).bf16
    assert not resolve_compute(ParallelConfig(device="cpu")).bf16
