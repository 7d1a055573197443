"""Every script in examples/ runs, as a user would start it, against real shards on localhost: the plain
PyTorch loop and the Hugging Face `Trainer` as two sites of one run each, the FSDP2 one under torchrun."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from tests.test_api import _finish

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _start(script: str, *args: str, torchrun: bool = False) -> subprocess.Popen:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        if torchrun
        else [sys.executable]
    )
    return subprocess.Popen(
        [*launcher, str(EXAMPLES / script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _at_the_end(shards, final_version: int) -> None:  # noqa: ANN001
    assert all(s.version == final_version for s in shards.shards)
    assert sum(s.status()["replay_mismatches"] for s in shards.shards) == 0


def test_examples_are_short():
    for script in EXAMPLES.glob("*.py"):
        # 70: what a page of a formatted script holds (ruff spreads a long call over lines; 65 before it ran)
        assert len(script.read_text().splitlines()) <= 70, script.name


def test_plain_pytorch_example_two_sites(shard_set):
    shards = shard_set(1, "own-loop", min_clusters=2)
    outs = _finish(
        *(
            _start("plain_pytorch.py", "--servers", shards.addresses[0], "--site", str(i), "--rounds", "3")
            for i in range(2)
        )
    )
    finals = [re.search(r"site \d done: eval loss ([\d.]+)", out) for out in outs]
    assert all(finals) and finals[0].group(1) == finals[1].group(1), outs  # both end on the run's one model
    rounds = [float(x) for x in re.findall(r"site 0 round \d: train loss [\d.]+, eval loss ([\d.]+)", outs[0])]
    assert len(rounds) == 3 and float(finals[0].group(1)) < 5.0  # trained: ln 256 = 5.55 is a uniform guess
    _at_the_end(shards, 4)  # 3 rounds and the flush


def test_hf_trainer_example_two_sites_of_a_tiny_llama(shard_set):
    shards = shard_set(1, "hf-trainer", min_clusters=2)
    sites = [
        _start("hf_trainer.py", "--servers", shards.addresses[0], "--site", str(i), "--rounds", "2", "--steps", "3")
        for i in range(2)
    ]
    outs = _finish(*sites)
    for i, out in enumerate(outs):
        assert f"hf-site-{i} done=True rounds=2 tokens={2 * 3 * 8 * 64}" in out, out[-2000:]
    assert all(sorted(s.members) == ["hf-site-0", "hf-site-1"] for s in shards.shards)
    _at_the_end(shards, 3)


def test_torchrun_fsdp2_example_one_site_of_two_ranks(shard_set):
    shards = shard_set(2, "fsdp2")
    out = _finish(_start("torchrun_fsdp2.py", "--servers", ",".join(shards.addresses), "--rounds", "2", torchrun=True))[
        0
    ]
    assert "round 2: train loss" in out and "fsdp2 site done" in out, out[-2000:]
    assert all(sorted(s.members) == ["fsdp2-site"] for s in shards.shards)  # two ranks, one site
    _at_the_end(shards, 3)


def test_the_hf_trainer_under_a_multi_process_launch_is_refused_by_name():
    """A `Trainer` launched over several processes (torchrun, `accelerate launch`: DDP or
    FSDP under accelerate) would join the run once per process as the same site; the callback's site refuses
    it by name, with the fix, before anything joins (the shard address here answers nothing)."""
    job = _start("hf_trainer.py", "--servers", "127.0.0.1:9", torchrun=True)
    _, err = job.communicate(timeout=300)
    assert job.returncode != 0
    assert "this process is one of 2 (WORLD_SIZE is set, as torchrun and accelerate do) but no mesh was given" in err, (
        err[-3000:]
    )
    assert "Hugging Face Trainer" in err and "one process per site" in err, err[-3000:]
