"""Bad launches are refused before they cost anything: a model's sizes checked field by field
and its memory against the machine before any weight is built; a torchrun job of the wrong world size;
a first connection bounded by --shard-wait-s."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from dilocox.common.config.run import InnerConfig, ModelConfig, ParallelConfig
from dilocox.worker.models.spec import ModelSpecError
from dilocox.worker.site.size_guard import check_model_size
from tests.cli_refusal import refusal

GB = 10**9


def _config_json(tmp_path, **fields) -> str:
    base = json.loads(
        (
            __import__("dilocox.worker.models.spec", fromlist=["presets_dir"]).presets_dir() / "llama-tiny.json"
        ).read_text()
    )
    base.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    return str(path)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_size": 0}, "hidden_size = 0 is outside"),
        ({"hidden_size": 66}, "hidden_size 66 is not divisible by num_attention_heads 4"),
        ({"hidden_size": "big"}, "hidden_size must be a whole number"),
        ({"num_hidden_layers": -1}, "num_hidden_layers = -1 is outside"),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers = 1000000 is outside"),
        ({"vocab_size": 10**9}, "vocab_size = 1000000000 is outside"),
        ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads 3"),
    ],
)
def test_each_malformed_field_is_one_line_naming_it(tmp_path, fields, message):
    pytest.importorskip("transformers")
    started = time.perf_counter()
    with pytest.raises(ModelSpecError, match=message):
        check_model_size(ModelConfig(model=_config_json(tmp_path, **fields)), 256, ParallelConfig())
    assert time.perf_counter() - started < 30  # nothing was built (a generous bound: a shared CI core)


def test_a_model_larger_than_the_machine_is_refused_with_its_size_before_it_is_built(tmp_path):
    pytest.importorskip("transformers")
    big = ModelConfig(
        model=_config_json(
            tmp_path,
            hidden_size=16384,
            intermediate_size=65536,
            num_hidden_layers=64,
            num_attention_heads=128,
            num_key_value_heads=8,
        )
    )
    with pytest.raises(
        ModelSpecError,
        match=r"B parameters need about .* of host memory here .* and 8.0 GB is available; "
        r"--spill-dir .* --checkpoint-staging sync keep 12 B",
    ):
        check_model_size(big, 256, ParallelConfig(), host_bytes=8 * GB)
    with pytest.raises(ModelSpecError, match="per GPU .* raise --pp"):
        check_model_size(big, 256, ParallelConfig(), host_bytes=10_000 * GB, device_bytes=80 * GB)
    # Pipelined with --pipeline-reshard step, torch's schedule keeps each stage's blocks gathered and their
    # gradients unsharded through the step (worker/site/memory_plan.py): at pp 8 × dp 8 that alone is
    # 6 B × 29B per GPU, and the guard says so; FSDP over 256 GPUs without stages, one short sequence per
    # GPU, fits.
    with pytest.raises(ModelSpecError, match=r"most of it grad_accumulators .* raise --pp"):
        check_model_size(
            big,
            256,
            ParallelConfig(pp=8, dp=8, microbatches=8, pipeline_reshard="step"),
            local_processes=8,
            host_bytes=10_000 * GB,
            device_bytes=80 * GB,
        )
    one_sequence = InnerConfig(batch_size=1)  # no activation checkpointing yet: 59 MB per token at this size
    sharded = check_model_size(
        dataclasses.replace(big, block_size=64),
        256,
        ParallelConfig(dp=256),
        local_processes=8,
        host_bytes=10_000 * GB,
        device_bytes=80 * GB,
        inner=one_sequence,
    )
    assert sharded.params > 200e9 and sharded.train_bytes_per_rank < 80 * GB
    assert sharded.build_bytes_per_process < 4 * sharded.params // 100  # one whole parameter at a time, not the model
    small = check_model_size(ModelConfig(), 256, ParallelConfig())
    assert 0 < small.params < 10**6


def test_builtin_gpt_sizes_are_bounded_by_flag_name():
    with pytest.raises(ModelSpecError, match="--n-layer = 1000000 is outside"):
        check_model_size(ModelConfig(n_layer=10**6), 256, ParallelConfig())


def _worker(tmp_path, *flags: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox.common.cli", "worker", "--insecure", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=tmp_path,
    )


def test_the_worker_refuses_a_huge_model_and_a_wrong_world_size_at_once(tmp_path, monkeypatch, capsys):
    """The huge model is refused in this process (tests/cli_refusal.py), the wrong world size by real ones:
    it is about the environment torchrun gives its processes."""
    monkeypatch.chdir(tmp_path)
    huge = "worker --insecure --servers 127.0.0.1:1 --n-layer 64 --n-embd 65536 --n-head 64".split()
    status, err = refusal(capsys, huge)
    assert status != 0 and "of host memory here" in err, err[-2000:]
    # Two processes of a torchrun job started with the default --pp 1 --dp 1: both refuse, naming it.
    wrong = _worker(tmp_path, "--servers", "127.0.0.1:1", env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert wrong.returncode != 0 and "2 processes" in wrong.stderr and "--pp 1 × --dp 1" in wrong.stderr, wrong.stderr[
        -2000:
    ]


def test_shard_wait_bounds_the_first_connection(tmp_path):
    started = time.monotonic()
    done = _worker(tmp_path, "--servers", "127.0.0.1:1", "--shard-wait-s", "3", "--rounds", "1", "--inner-steps", "1")
    took = time.monotonic() - started
    assert done.returncode == 2 and took < 45, (took, done.stderr[-2000:])


def test_server_rounds_needs_resume(tmp_path, monkeypatch, capsys):
    """In this process (tests/cli_refusal.py); tests/test_stalled_streams.py runs a real server's refusal."""
    monkeypatch.chdir(tmp_path)
    status, err = refusal(capsys, ["server", "--rounds", "5", "--port", "0", "--insecure"])
    assert status != 0 and "--rounds extends a run from its checkpoint and needs --resume" in err


def test_sigterm_of_a_torchrun_site_stops_it_cleanly_without_a_traceback(shard_set):
    """`dilocox worker --dp 2` runs its torchrun job in-process; a SIGTERM reaches every
    rank (each finishes its round in flight), and the launcher ends with one line and exit 143."""
    import signal

    shards = shard_set(1, "sigterm-run")
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "worker",
        "--servers",
        shards.addresses[0],
        "--run-id",
        "sigterm-run",
        "--insecure",
        "--dp",
        "2",
        "--rounds",
        "100000",
        "--inner-steps",
        "5",
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
    site = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any('"round_done"' in line for line in lines):
            line = site.stderr.readline()
            if not line and site.poll() is not None:
                break
            lines.append(line)
        assert any('"round_done"' in line for line in lines), "".join(lines)[-3000:]
        site.send_signal(signal.SIGTERM)
        _, rest = site.communicate(timeout=90)
    finally:
        if site.poll() is None:
            site.kill()
    err = "".join(lines) + rest
    assert site.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert '"site_stopped"' in err and err.count('"communicator_closed"') == 2  # each rank took its graceful path
