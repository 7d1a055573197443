"""A run's end is explicit: the shards know the run's final version from its recorded
configuration, `dilocox status` says `finished`, and a site that starts after the end exits non-zero
naming the run's state instead of training nothing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from dilocox.common.config.run import InnerConfig, ModelConfig, RunConfig, final_version_of
from dilocox.common.wire.compression import CompressionConfig
from dilocox.sim.inprocess import run_in_process

RUN = "ending-run"


def test_final_version_counts_the_rounds_and_the_flush():
    config = RunConfig(rounds=7)
    assert config.final_version == 8  # the default compression ends with the flush of the residuals
    assert dataclasses.replace(config, compress=CompressionConfig(codec="fp32")).final_version == 7
    assert dataclasses.replace(config, compress=CompressionConfig(flush_codec="none")).final_version == 7
    assert dataclasses.replace(config, compress=CompressionConfig(local_residual=False)).final_version == 7
    assert final_version_of("{}") is None and final_version_of("not json") is None


def test_status_says_finished_and_a_late_site_is_told_the_run_is_over(tmp_path):
    config = RunConfig(
        run_id=RUN,
        rounds=2,
        eval_batches=1,
        model=ModelConfig(n_layer=1, n_embd=32, block_size=32),
        inner=InnerConfig(steps=3, batch_size=4, warmup_steps=2),
    )
    seen = {}

    def after_the_run(addresses: list[str]) -> None:
        cli = [sys.executable, "-m", "dilocox.common.cli"]
        seen["status"] = subprocess.run(
            [*cli, "status", "--servers", ",".join(addresses), "--insecure"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        seen["late"] = subprocess.run(
            [
                *cli,
                "worker",
                "--servers",
                ",".join(addresses),
                "--run-id",
                RUN,
                "--cluster",
                "latecomer",
                "--insecure",
                "--rounds",
                "2",
                "--n-layer",
                "1",
                "--n-embd",
                "32",
                "--block-size",
                "32",
                "--inner-batch-size",
                "4",
                "--inner-steps",
                "3",
                "--eval-batches",
                "1",
                "--log-format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )

    result = run_in_process(config, num_clusters=2, num_shards=2, before_stop=after_the_run, timeout_s=300)
    assert all(s.status()["state"] == "finished" and s.status()["final_version"] == 3 for s in result.shards)
    status = seen["status"]
    assert status.returncode == 0 and status.stdout.count("finished") >= 3, status.stdout
    assert f"run {RUN} finished at version 3" in status.stdout
    late = seen["late"]
    assert late.returncode == 3, late.stderr[-3000:]
    assert "has finished: the shards hold its final version 3" in late.stderr and "dilocox export" in late.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shards_exit_by_themselves_once_every_cluster_holds_the_final_version(tmp_path):
    """Real processes: one shard without --keep-serving, two sites of 2 rounds; the shard stops (exit 0,
    a last checkpoint) as soon as both sites have pulled the final version (2 rounds + the flush)."""
    import json

    cli = [sys.executable, "-m", "dilocox.common.cli"]
    port = _free_port()
    shard = subprocess.Popen(
        [
            *cli,
            "server",
            "--port",
            str(port),
            "--run-id",
            RUN,
            "--min-clusters",
            "2",
            "--round-deadline-s",
            "0",
            "--checkpoint-dir",
            str(tmp_path),
            "--log-format",
            "json",
            "--insecure",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    sites = [
        subprocess.Popen(
            [
                *cli,
                "worker",
                "--servers",
                f"127.0.0.1:{port}",
                "--run-id",
                RUN,
                "--cluster",
                f"site-{i}",
                "--cluster-index",
                str(i),
                "--num-clusters",
                "2",
                "--insecure",
                "--rounds",
                "2",
                "--n-layer",
                "1",
                "--n-embd",
                "32",
                "--block-size",
                "32",
                "--inner-batch-size",
                "4",
                "--inner-steps",
                "3",
                "--eval-batches",
                "1",
                "--threads",
                "1",
                "--log-format",
                "json",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        for site in sites:
            _, err = site.communicate(timeout=240)
            assert site.returncode == 0, err[-3000:]
        _, shard_log = shard.communicate(timeout=120)  # a hang guard: a shard that kept serving would never exit
        assert shard.returncode == 0
    finally:
        for proc in [*sites, shard]:
            if proc.poll() is None:
                proc.kill()
    events = [json.loads(line) for line in shard_log.splitlines() if line.startswith("{")]
    finished = [e for e in events if e["event"] == "run_finished"]
    assert finished and finished[0]["version"] == 3 and finished[0]["clusters"] == ["site-0", "site-1"]
    from dilocox.server.state import checkpoint

    assert checkpoint.load(tmp_path / "shard-0.pt")["snapshot"]["version"] == 3


def test_late_cluster_new_to_a_run_is_refused_unless_it_asks_to_join_late(shard_set):
    """A site new to the run arriving after rounds closed says how many rounds it would miss and exits 3;
    the shard reports a returning cluster as a rejoin, also after the deadline dropped it from the members."""
    import json

    import torch

    from dilocox.common.config.run import as_dict
    from dilocox.worker.exchange.aggregator_client import AggregatorClient
    from dilocox.worker.exchange.cluster import slice_tensors
    from dilocox.worker.models.build import model_param_specs

    model = ModelConfig(n_layer=1, n_embd=32, block_size=32)
    config = RunConfig(run_id=RUN, rounds=4, model=model)
    specs = model_param_specs(model, 256)
    shards = shard_set(1, RUN)
    with AggregatorClient(shards.addresses, RUN, "early", shard_wait_s=0) as client:
        info = client.join(specs, json.dumps(as_dict(config)))
        assert not info.rejoin
        weights = {name: torch.zeros(shape) for name, shape in specs}
        client.push(0, 1.0, slice_tensors(client.assignment, weights))
        client.push(1, 1.0, slice_tensors(client.assignment, weights))  # round 1 closes: version 1
    assert shards.shards[0].version == 1
    flags = [
        "--run-id",
        RUN,
        "--insecure",
        "--rounds",
        "4",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--inner-batch-size",
        "4",
        "--eval-batches",
        "1",
        "--log-format",
        "json",
    ]
    late = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "worker",
            "--servers",
            shards.addresses[0],
            "--cluster",
            "late",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert late.returncode == 3, late.stderr[-3000:]
    assert (
        "is at version 1" in late.stderr
        and "would train 3 of its 4 rounds" in late.stderr
        and "--join-late" in late.stderr
    )
    del shards.shards[0].members["early"]  # as a missed deadline does
    with AggregatorClient(shards.addresses, RUN, "early", shard_wait_s=0) as client:
        assert client.join(specs).rejoin
