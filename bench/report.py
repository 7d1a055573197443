"""Benchmark output: a Markdown table for people, JSON for machines, both in one results folder."""

from __future__ import annotations

import datetime
import json
import pathlib


def results_dir(out: str | None) -> pathlib.Path:
    path = (
        pathlib.Path(out) if out else pathlib.Path("bench/results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def cell(value: object) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_report(
    out_dir: pathlib.Path,
    name: str,
    title: str,
    rows: list[dict],
    columns: list[str],
    notes: str = "",
    meta: dict | None = None,
) -> str:
    """Write <name>.md and <name>.json; returns the Markdown."""
    text = f"# {title}\n\n{markdown_table(rows, columns)}\n\n{notes}".rstrip() + "\n"
    (out_dir / f"{name}.md").write_text(text)
    (out_dir / f"{name}.json").write_text(json.dumps({"rows": rows, "meta": meta or {}}, indent=2))
    return text
