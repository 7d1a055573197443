"""A Hugging Face Llama through the whole system: `dilocox sim` with real shard and cluster processes on
localhost gRPC, a BPE tokenizer, the one-step delay and the default compression; also as PP=2 gloo
pipelines, and the worker's refusals of models, tokenizers and devices it cannot use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

SMALL = [
    "--model",
    "llama-tiny",
    "--tokenizer",
    "bpe:512",
    "--rounds",
    "3",
    "--inner-steps",
    "5",
    "--block-size",
    "32",
    "--inner-batch-size",
    "8",
    "--eval-batches",
    "2",
    "--inner-warmup-steps",
    "2",
]


def _env(tmp_path) -> dict:
    return {**os.environ, "DILOCOX_CACHE_DIR": str(tmp_path / "cache")}


def _sim(tmp_path, *extra: str) -> dict:
    summary = tmp_path / "summary.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dilocox.common.cli",
            "sim",
            *SMALL,
            *extra,
            "--log-dir",
            str(tmp_path / "logs"),
            "--summary-json",
            str(summary),
            "--timeout",
            "240",
            "--log-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(tmp_path),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(summary.read_text())


@pytest.mark.parametrize("pp", [1])
def test_tiny_llama_trains_through_the_whole_sim(tmp_path, pp):
    """Delay 1 and the default compression (low rank + int4 + error feedback + flush) on a BPE-tokenised
    corpus. (A Llama site of two gloo pipeline stages is trained by tests/test_sharded_build.py and
    tests/test_memory_plan.py; `pp` stays a parameter to run it here too: `-k` and a local edit.)"""
    summary = _sim(tmp_path, "--pp", str(pp))
    assert summary["ok"] and summary["rounds"] == 3 and summary["delay"] == 1
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.3  # ln(512) = 6.24 at the start
    logs = [
        json.loads(line)
        for name in ("cluster-0", "cluster-1")
        for line in (tmp_path / "logs" / f"{name}.log").read_text().splitlines()
        if line.startswith("{")
    ]
    started = [e for e in logs if e.get("event") == "worker_starting"]
    assert started and all(
        e["model"] == "llama-tiny" and e["vocab"] == 512 and e["tokenizer"] == "bpe:512" for e in started
    )
    assert summary["bytes_up"] > 0 and summary["flush_bytes_up"] > 0  # compressed rounds, then the flush
    if pp == 2:
        ready = [e for e in logs if e.get("event") == "rank_ready"]
        assert len(ready) == 4 and {e["backend"] for e in ready} == {"gloo"}


WORKER = ["worker", "--servers", "127.0.0.1:1", "--insecure"]


def _worker(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox.common.cli", *WORKER, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(tmp_path),
    )


def _refusal(tmp_path, monkeypatch, capsys, *extra: str) -> tuple[int, str]:
    """`dilocox worker` refusing in this process (tests/cli_refusal.py), with the environment `_worker` gives."""
    from tests.cli_refusal import refusal

    monkeypatch.setenv("DILOCOX_CACHE_DIR", str(tmp_path / "cache"))
    return refusal(capsys, [*WORKER, *extra])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "llama-2O"], "is not a known model"),
        (["--model", "gpt2-small", "--pp", "2"], "cannot split GPT2LMHeadModel"),
        (["--tokenizer", "bpe:12"], "above 257"),
    ],
)
def test_the_worker_refuses_what_it_cannot_train_before_connecting(tmp_path, monkeypatch, capsys, flags, message):
    """Each refused before a connection or a torchrun job; in this process, the corpus path's case below is a
    real one."""
    status, err = _refusal(tmp_path, monkeypatch, capsys, *flags)
    assert status != 0 and message in err, err[-2000:]


def test_a_real_worker_process_refuses_a_corpus_that_is_not_there(tmp_path):
    """The worker's refusal as a process: the message on its stderr and a failing exit status."""
    done = _worker(tmp_path, "--data", "/no/such/corpus")
    assert done.returncode != 0 and "corpus path does not exist" in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_asked_for_where_there_is_none(tmp_path, monkeypatch, capsys):
    status, err = _refusal(tmp_path, monkeypatch, capsys, "--device", "cuda")
    assert status != 0 and "--device cuda: no CUDA device is available here" in err
