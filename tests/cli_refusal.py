"""A command's refusal checked in this process: `dilocox.common.cli.main(argv)` called under pytest's `capsys`,
with the exit code Python itself would give the same `SystemExit` (its message printed to stderr, status 1).

A process that exists only to print a refusal costs 2-6 s of start-up (torch, transformers) for one line of
text; each command keeps one real-process case elsewhere for its real exit path. What the command changes in
the process on its way to the refusal (structlog's output, signal handlers, environment variables, torch's
thread count, the root logger) is put back, so the tests after it see the process they expect."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable

import pytest
import structlog


def _exit_status(code: object) -> int:
    """What the interpreter exits with for `SystemExit(code)`: None is 0, an int is itself, anything else is
    printed to stderr and is 1 (how `raise SystemExit("dilocox worker: ...")` reaches a shell)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _handlers() -> dict[signal.Signals, object]:
    return {s: h for s in signal.valid_signals() if (h := signal.getsignal(s)) is not None}


def in_process(capsys: pytest.CaptureFixture[str], command: Callable[[], int | None]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `command()` run here: a return is its status (as `sys.exit(main())`
    makes it), a `SystemExit` is mapped as the interpreter maps it. Output before the call is dropped: the
    result holds only the command's own, as a child's pipes would."""
    capsys.readouterr()
    logging_config, handlers, environ = structlog.get_config(), _handlers(), dict(os.environ)
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        try:
            status = _exit_status(command())
        except SystemExit as stop:
            status = _exit_status(stop.code)
    finally:
        structlog.configure(**logging_config)
        for signum, handler in _handlers().items():  # e.g. a shard's or a site's SIGTERM/SIGINT handlers
            if signum in handlers and handler is not handlers[signum]:
                signal.signal(signum, handlers[signum])
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of `dilocox <argv>` run in this process."""
    from dilocox.common.cli import main

    status, _, err = in_process(capsys, lambda: main(argv))
    return status, err
