"""The `dilocox worker` command of the real-process tests that need a site but not its model: a one-layer,
32-wide GPT on the bundled bytes, one thread, plaintext to localhost shards, JSON logs to read back."""

from __future__ import annotations

import sys

TINY_MODEL = ("--n-layer", "1", "--n-embd", "32", "--block-size", "32", "--inner-batch-size", "4", "--eval-batches", "1")


def worker_argv(addresses: list[str], run_id: str, *flags: str) -> list[str]:
    """`dilocox worker` against `addresses` in run `run_id`, with the tiny model and `flags` (rounds, H, layout…)."""
    return [sys.executable, "-m", "dilocox.common.cli", "worker", "--servers", ",".join(addresses), "--run-id", run_id,
            *TINY_MODEL, "--threads", "1", "--insecure", "--log-format", "json", *flags]  # fmt: skip
