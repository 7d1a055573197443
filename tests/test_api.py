"""The public API: a user's own loop over `dilocox.DiLoCoX` is a site like the CLI's.

Real shards on localhost ports, real processes for the sites: `dilocox worker` and a user-written loop
(tests/sites/own_loop_site.py) train one run together to its end; alone, each gives the same bits for the
same configuration and seed; a loop site stopped after a round and reloaded from its `state_dict()` ends
on the shards' model with the replay check clean.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from dilocox.common.config.run import InnerConfig, ModelConfig, RunConfig, to_toml
from dilocox.worker.exchange.packed_state import unpack

RUN = "api-run"
HERE = pathlib.Path(__file__).parent
CONFIG = RunConfig(
    run_id=RUN,
    rounds=3,
    eval_batches=1,
    model=ModelConfig(n_layer=1, n_embd=32, block_size=32),
    inner=InnerConfig(steps=3, batch_size=4, warmup_steps=2),
)
CLI = [sys.executable, "-m", "dilocox.common.cli"]


def _config_file(tmp_path: pathlib.Path, config: RunConfig = CONFIG) -> pathlib.Path:
    path = tmp_path / "run.toml"
    path.write_text(to_toml(config))
    return path


def _cli_site(servers: str, config: pathlib.Path, index: int, clusters: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *CLI,
            "worker",
            "--servers",
            servers,
            "--config",
            str(config),
            "--cluster",
            f"cli-{index}",
            "--cluster-index",
            str(index),
            "--num-clusters",
            str(clusters),
            "--insecure",
            "--threads",
            "1",
            "--log-format",
            "json",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _loop_site(
    servers: str, config: pathlib.Path, index: int, clusters: int, out: pathlib.Path, *extra: str
) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "sites" / "own_loop_site.py"),
            "--servers",
            servers,
            "--config",
            str(config),
            "--cluster",
            f"loop-{index}",
            "--cluster-index",
            str(index),
            "--num-clusters",
            str(clusters),
            "--out",
            str(out),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(*sites: subprocess.Popen, timeout_s: float = 300.0) -> list[str]:
    """Wait for every site to exit 0; the first to fail (or the deadline) stops the others (which would
    otherwise wait for it) and fails the test with its stderr."""
    deadline = time.monotonic() + timeout_s
    while any(site.poll() is None for site in sites) and time.monotonic() < deadline:
        if any(site.poll() not in (None, 0) for site in sites):
            break
        time.sleep(0.2)
    for site in sites:
        if site.poll() is None:
            site.kill()
    results = [site.communicate(timeout=30) for site in sites]
    for site, (_, err) in zip(sites, results):
        assert site.returncode == 0, (site.args[:3], site.returncode, (err or "")[-4000:])
    return [out or "" for out, _ in results]


def _shards_model(shards) -> dict:  # noqa: ANN001
    """The shards' global model, slice by slice: {slice key: tensor}."""
    return {key: t.clone() for shard in shards.shards for key, t in shard.snapshot.tensors.items()}


def _assert_model_is_the_shards(weights: dict[str, torch.Tensor], shards) -> None:  # noqa: ANN001
    for shard in shards.shards:
        for s in shard.assignment:
            if s.shard == shard.shard_index:
                want = shard.snapshot.tensors[s.key].reshape(s.slice_shape)
                assert torch.equal(s.view(weights[s.name]), want), s.key


def test_a_cli_site_and_an_own_loop_site_train_one_run_to_its_end(shard_set, tmp_path):
    shards = shard_set(2, RUN, min_clusters=2)
    config, servers = _config_file(tmp_path), ",".join(shards.addresses)
    out = _finish(_cli_site(servers, config, 0, 2), _loop_site(servers, config, 1, 2, tmp_path / "loop.pt"))[1]
    assert f"rounds={CONFIG.rounds}" in out
    assert all(s.version == CONFIG.final_version for s in shards.shards)  # the rounds, then the flush
    assert all(sorted(s.members) == ["cli-0", "loop-1"] for s in shards.shards)
    _assert_model_is_the_shards(torch.load(tmp_path / "loop.pt"), shards)  # the loop's model is the run's
    assert sum(s.status()["replay_mismatches"] for s in shards.shards) == 0


def test_the_own_loop_gives_the_cli_workers_bits(shard_set, tmp_path):
    """Same configuration, seed and data: a run of one CLI site and a run of one loop site end on the same
    global model, bit for bit (the same rounds, delay, compression and flush, through one code path). With the
    merge at the boundary (`overlap_steps = 0`): a merge a step into the round comes at the step the exchange is
    back, which the machine's pace decides, so two runs' bits agree only where that is fixed."""
    config = _config_file(tmp_path, dataclasses.replace(CONFIG, overlap_steps=0))
    by_cli = shard_set(2, RUN)
    _finish(_cli_site(",".join(by_cli.addresses), config, 0, 1))
    by_loop = shard_set(2, RUN)
    _finish(_loop_site(",".join(by_loop.addresses), config, 0, 1, tmp_path / "loop.pt"))
    cli_model, loop_model = _shards_model(by_cli), _shards_model(by_loop)
    assert (
        cli_model.keys() == loop_model.keys()
        and by_cli.shards[0].version == by_loop.shards[0].version == CONFIG.final_version
    )
    different = [key for key in cli_model if not torch.equal(cli_model[key], loop_model[key])]
    assert not different, different


@pytest.mark.parametrize("stop_after", [1])
def test_a_site_reloaded_from_its_state_dict_ends_on_the_shards_model(shard_set, tmp_path, stop_after):
    shards = shard_set(2, RUN)
    config, servers = _config_file(tmp_path), ",".join(shards.addresses)
    _finish(_loop_site(servers, config, 0, 1, tmp_path / "state.pt", "--stop-after-round", str(stop_after)))
    saved = torch.load(tmp_path / "state.pt", weights_only=False)["dilocox"]
    assert saved["round"] == stop_after + 1 and any(unpack(v) for v in saved["exchange"].values()), (
        saved.keys()
    )  # the residuals
    assert all(s.version == stop_after for s in shards.shards)  # the round in flight at the stop reached the shards
    out = _finish(_loop_site(servers, config, 0, 1, tmp_path / "final.pt", "--resume", str(tmp_path / "state.pt")))[0]
    assert f"rounds={CONFIG.rounds - stop_after}" in out  # it trained the rounds left, not the run again
    resumed = next(line for line in out.splitlines() if "replica_resumed" in line)  # by delta, from the
    assert "how=delta" in resumed and ("rounds_replayed=1" in resumed or "rounds_replayed=0" in resumed), (
        resumed
    )  # state's replica
    assert all(s.version == CONFIG.final_version for s in shards.shards)
    _assert_model_is_the_shards(torch.load(tmp_path / "final.pt"), shards)
    assert sum(s.status()["replay_mismatches"] for s in shards.shards) == 0
