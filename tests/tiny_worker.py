"""The `dilocox worker` command of the real-process tests that need a site but not its model: a one-layer,
32-wide GPT on the bundled bytes, one thread, plaintext to localhost shards, JSON logs to read back."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

TINY_MODEL = (
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
)


def worker_argv(addresses: list[str], run_id: str, *flags: str) -> list[str]:
    """`dilocox worker` against `addresses` in run `run_id`, with the tiny model and `flags` (rounds, H, layout…)."""
    return [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "worker",
        "--servers",
        ",".join(addresses),
        "--run-id",
        run_id,
        *TINY_MODEL,
        "--threads",
        "1",
        "--insecure",
        "--log-format",
        "json",
        *flags,
    ]


def tiny_worker(addresses: list[str], run_id: str, *flags: str) -> subprocess.Popen:
    """A tiny worker process (`worker_argv`), its stderr (the JSON log) piped to read back."""
    return subprocess.Popen(
        worker_argv(addresses, run_id, *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def stop_once_at(proc: subprocess.Popen, shard, version: int, timeout_s: float = 120.0) -> None:  # noqa: ANN001 - a Shard
    """SIGTERM `proc` once `shard` has published `version` (or `timeout_s` passed, or it ended), and check it
    stopped as a stopped worker does: exit 143, its checkpoint written. Killed if it outlives the check."""
    try:
        deadline = time.monotonic() + timeout_s
        while shard.version < version and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == 143, f"exit {code}: " + proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
