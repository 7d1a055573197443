"""Reading the JSON log lines (`--log-format json`) a test's processes wrote to a file."""

from __future__ import annotations

import json
import pathlib


def json_events(path: pathlib.Path) -> list[dict]:
    """Every JSON event in `path` (other lines, e.g. a launcher's own output, are skipped; no file: none)."""
    events = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events
