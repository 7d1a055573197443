"""Several pipeline stages a rank (`--schedule interleaved-1f1b --stages-per-rank v`): torch's
ScheduleInterleaved1F1B (or ScheduleInterleavedZeroBubble, `interleaved-zb`) over the rank's stages, each its own FSDP
root, together under the model's names
(RankStages). Each microbatch meets the same blocks in the same order as under 1F1B and the gradients add
up in the same order, so the site trains bit for bit as the 1F1B site does — on gloo ranks in both
reshard modes, and as a whole run against real shards (0 replay mismatches)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from dilocox.common.config.run import ParallelConfig
from dilocox.worker.site.pipeline_memory import bubble_fraction, in_flight_layers
from tests.gloo_ranks import as_torchrun_rank, start_ranks
from tests.test_site import BATCH, STEPS, _full, config, data, free_port, global_batches, train_recording
from tests.tiny_worker import worker_argv

LAYOUTS = {"1f1b": ("1f1b", 1), "interleaved": ("interleaved-1f1b", 2)}


def _interleaved(rank: int, world: int, port: int, out_dir: str, reshard: str) -> None:
    as_torchrun_rank(rank, world, port)
    from dilocox.worker.site.mesh import SiteMesh
    from dilocox.worker.site.trainer import SiteTrainer

    mesh = SiteMesh(config(2, 2).parallel, collective_timeout_s=120)
    result = {}
    try:
        for name, (schedule, per_rank) in {
            **LAYOUTS,
            **({"zero-bubble": ("interleaved-zb", 2)} if reshard == "step" else {}),
        }.items():
            cfg = config(2, 2, accum=2, reshard=reshard)
            cfg = dataclasses.replace(
                cfg,
                model=dataclasses.replace(cfg.model, model="gpt", n_layer=4, n_embd=64),
                parallel=dataclasses.replace(cfg.parallel, schedule=schedule, stages_per_rank=per_rank),
            )
            trainer = SiteTrainer(cfg, data(), mesh)
            _, losses = train_recording(trainer, mesh.replica, global_batches(STEPS * 2, BATCH * 2), STEPS)
            result[name] = {
                "losses": losses,
                "eval": trainer.evaluate(),
                "weights": {n: _full(p) for n, p in trainer.named_parameters()},
                "names": [n for n, _ in trainer.named_parameters()],
            }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        mesh.close()


@pytest.mark.parametrize("reshard", ["step", "microbatch"])
@pytest.mark.usefixtures("rank_forkserver")
def test_two_stages_a_rank_train_bit_for_bit_as_one(reshard, tmp_path):
    world = 4
    start_ranks(_interleaved, world, (world, free_port(), str(tmp_path), reshard))
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    one = {n: t for part in parts for n, t in part["1f1b"]["weights"].items()}  # the whole model, from its ranks
    for other in ("interleaved", "zero-bubble") if reshard == "step" else ("interleaved",):
        for part in parts:
            assert part["1f1b"]["losses"] == part[other]["losses"] and part["1f1b"]["eval"] == part[other]["eval"], (
                other
            )
        two = {n: t for part in parts for n, t in part[other]["weights"].items()}
        assert one.keys() == two.keys() and all(torch.equal(one[n], two[n]) for n in one), other
    # rank 0 holds stages 0 and 2 of 4 (the embeddings, blocks 0 and 2), rank 2 stages 1 and 3 (blocks 1 and 3,
    # the head)
    assert [n.split(".")[1] for n in parts[0]["interleaved"]["names"] if n.startswith("blocks.")][::12] == ["0", "2"]
    assert parts[2]["interleaved"]["names"][-1] == "head.weight"


def test_an_interleaved_site_ends_on_the_1f1b_sites_model_against_real_shards(shard_set, tmp_path):
    """Two runs of one pp 2 site each (torchrun, gloo), the same seed and data: the interleaved one ends on
    the 1F1B one's global model, bit for bit, and neither saw a replay mismatch (merged at the boundary, so that
    the two runs' numerics do not depend on when each exchange came back)."""
    import subprocess

    models = {}
    for name, (schedule, per_rank) in LAYOUTS.items():
        shards = shard_set(2, f"inter-{name}")
        cmd = worker_argv(
            shards.addresses,
            f"inter-{name}",
            "--rounds",
            "2",
            "--inner-steps",
            "2",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--n-layer",
            "4",
            "--schedule",
            schedule,
            "--stages-per-rank",
            str(per_rank),
            "--overlap-steps",
            "0",  # the merge at the boundary: a mid-round merge's step is the machine's pace, and differs by run
        )
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert sum(s.status()["replay_mismatches"] for s in shards.shards) == 0
        models[name] = {k: t.clone() for s in shards.shards for k, t in s.snapshot.tensors.items()}
    assert models["1f1b"].keys() == models["interleaved"].keys()
    assert all(torch.equal(models["1f1b"][k], models["interleaved"][k]) for k in models["1f1b"])


def test_the_plan_counts_what_torchs_interleaved_schedule_holds_and_idles():
    """Interleaving shrinks the bubble (pp − 1)/(v·m + pp − 1) for activations held longer: rank 0 of pp 4
    with 2 stages of 5 blocks holds 55 block-microbatches at its peak, against 40 under 1F1B."""
    assert bubble_fraction(8, 8) == pytest.approx(7 / 15) and bubble_fraction(8, 8, 4) == pytest.approx(7 / 39)
    assert bubble_fraction(2, 8, 2) < 0.1 <= bubble_fraction(2, 8)
    assert [in_flight_layers("1f1b", r, 4, 8, (10,)) for r in range(4)] == [40, 30, 20, 10]
    assert [in_flight_layers("interleaved-1f1b", r, 4, 8, (5, 5)) for r in range(4)] == [55, 45, 35, 25]
    with pytest.raises(ValueError, match="more than one stage a rank is the interleaved schedules'"):
        ParallelConfig(pp=2, stages_per_rank=2)
    with pytest.raises(ValueError, match="interleaved-zb splits each backward in two"):
        ParallelConfig(pp=2, schedule="interleaved-zb", pipeline_reshard="microbatch")
    # zero bubble: weight backwards fill most of the idle slots, for more activations held
    assert bubble_fraction(4, 8, 2, "interleaved-zb") < bubble_fraction(4, 8, 2) / 2
    assert in_flight_layers("interleaved-zb", 0, 4, 8, (5, 5)) >= in_flight_layers("interleaved-1f1b", 3, 4, 8, (5, 5))
