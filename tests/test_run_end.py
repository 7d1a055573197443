"""A run's end is explicit (issue 25, part): the shards know the run's final version from its recorded
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
    config = RunConfig(run_id=RUN, rounds=2, eval_batches=1, model=ModelConfig(n_layer=1, n_embd=32, block_size=32),
                       inner=InnerConfig(steps=3, batch_size=4, warmup_steps=2))  # fmt: skip
    seen = {}

    def after_the_run(addresses: list[str]) -> None:
        cli = [sys.executable, "-m", "dilocox.common.cli"]
        seen["status"] = subprocess.run([*cli, "status", "--servers", ",".join(addresses), "--insecure"],
                                        capture_output=True, text=True, timeout=120)  # fmt: skip
        seen["late"] = subprocess.run(
            [*cli, "worker", "--servers", ",".join(addresses), "--run-id", RUN, "--cluster", "latecomer", "--insecure",
             "--rounds", "2", "--n-layer", "1", "--n-embd", "32", "--block-size", "32", "--inner-batch-size", "4",
             "--inner-steps", "3", "--eval-batches", "1", "--log-format", "json"],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    result = run_in_process(config, num_clusters=2, num_shards=2, before_stop=after_the_run, timeout_s=300)
    assert all(s.status()["state"] == "finished" and s.status()["final_version"] == 3 for s in result.shards)
    status = seen["status"]
    assert status.returncode == 0 and status.stdout.count("finished") >= 3, status.stdout
    assert f"run {RUN} finished at version 3" in status.stdout
    late = seen["late"]
    assert late.returncode == 3, late.stderr[-3000:]
    assert "has finished: the shards hold its final version 3" in late.stderr and "dilocox export" in late.stderr
