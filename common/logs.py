"""structlog set-up: key=value lines for people, JSON lines for machines (the sim parses them)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def add_log_format_argument(parser) -> None:  # noqa: ANN001
    """`--log-format`, the same on every command that logs."""
    parser.add_argument(
        "--log-format",
        choices=("kv", "json"),
        default="kv",
        help="kv: key=value lines for people (default); json: one JSON object per line, for log shippers",
    )


# Libraries whose import-time warnings are about kernels a CPU build cannot load or a registration torch
# deprecates, not about the run: torchao (the light optimizer state; transformers imports it too where it is
# installed) and the torch pytree registrations it makes.
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def quiet_import_noise() -> None:
    """Only errors from the `IMPORT_NOISE` loggers (stdlib logging; ours is structlog)."""
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)


def configure_logging(fmt: str = "kv", level: str = "info", stream: TextIO | None = None) -> None:
    """Route every `structlog.get_logger()` call of this process to `stream` (stderr by default).

    fmt: "kv" → `event=round_closed round=12 …`; "json" → one JSON object per line.
    """
    if fmt not in ("kv", "json"):
        raise ValueError(f"log format must be 'kv' or 'json', got {fmt!r}")
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.processors.KeyValueRenderer(key_order=["timestamp", "level", "event"], drop_missing=True)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # One write per line (message + newline together): the ranks of a torchrun job share one pipe.
        logger_factory=structlog.WriteLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
