"""`dilocox bench gpu`: skipped without CUDA; its checks themselves, run on the CPU (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run for real")
def test_gpu_check_is_skipped_without_cuda(tmp_path, capsys):
    """In this process (tests/cli_refusal.py): it prints and returns before starting anything; the check
    below runs `dilocox bench gpu` as a real process."""
    from dilocox.common.cli import main
    from tests.cli_refusal import in_process

    status, out, err = in_process(capsys, lambda: main(["bench", "gpu", "--out", str(tmp_path)]))
    assert status == 0, err[-2000:]
    assert out.startswith("SKIPPED: no CUDA device here") and "--device cpu" in out


def test_gpu_check_runs_on_the_cpu(tmp_path):
    """One of its checks on gloo (pp=2 with accumulated batches, against real shards), with its figures;
    the others are the same machinery with other layouts."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "bench",
            "gpu",
            "--device",
            "cpu",
            "--quick",
            "--only",
            "accum",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert row["check"] == "accum" and row["status"] == "ok" and row["replay_mismatches"] == 0
    assert row["tokens_per_s"] > 0 and len(row["exchange_bytes_per_held_param"]) == 2
    assert (
        len(row["planned_device_mb_per_rank"]) == 2 and min(row["planned_device_mb_per_rank"]) > 0
    )  # the plan, beside the measured peak
    assert {"read_s", "write_s", "eval_s"} <= set(row["boundary_phases_s"])
