"""The documentation's runnable command blocks run as written.

A line `<!-- runnable -->` (or `<!-- runnable timeout=120 -->`) right before a ```bash fence in README.md
or docs/*.md marks that block: it is run here with `bash -euo pipefail` from the repository root, with
HOME and TMPDIR in a fresh temporary folder and no DILOCOX_* variable set, and must exit 0 within its
timeout (60 s unless the marker says otherwise) times LOAD_ALLOWANCE: the marker says what the block needs
on an idle machine, and the test only guards against a hang (a loaded 2-core machine ran `docs reference
--check` past its 60 s, successfully). So a command the docs show cannot drift from the CLI
without a test failing. The convention is described in docs/architecture.md, "The documentation".
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- runnable(?: timeout=(\d+))? -->$")
DEFAULT_TIMEOUT_S = 60
LOAD_ALLOWANCE = 5  # a hang guard, not a speed check: CI shares 2 cores with other tests


@dataclass(frozen=True)
class Block:
    document: pathlib.Path
    line: int  # 1-based line of the marker
    timeout_s: int
    script: str

    @property
    def name(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def _documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _marker_lines(lines: list[str]) -> list[int]:
    """0-based indices of every line that looks like a runnable marker, well-formed or not (outside fences)."""
    found, fenced = [], False
    for i, line in enumerate(lines):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
        elif not fenced and line.strip().startswith("<!--") and "runnable" in line:
            found.append(i)
    return found


def marked_blocks(document: pathlib.Path) -> list[Block]:
    lines = document.read_text().splitlines()
    blocks = []
    for i in _marker_lines(lines):
        match = MARKER.match(lines[i].strip())
        if not match or i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
            continue  # reported by test_markers_are_only_right_before_a_bash_fence
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            continue
        blocks.append(
            Block(document, i + 1, int(match.group(1) or DEFAULT_TIMEOUT_S), "\n".join(lines[i + 2 : end]) + "\n")
        )
    return blocks


BLOCKS = [block for document in _documents() for block in marked_blocks(document)]


def test_markers_are_only_right_before_a_bash_fence():
    """Every marker is well-formed, sits on the line right before a ```bash fence, and that fence closes."""
    bad = []
    for document in _documents():
        lines = document.read_text().splitlines()
        for i in _marker_lines(lines):
            where = f"{document.relative_to(ROOT)}:{i + 1}"
            if not MARKER.match(lines[i].strip()):
                bad.append(
                    f"{where}: malformed marker {lines[i].strip()!r} (want `<!-- runnable -->` or `<!-- runnable "
                    "timeout=N -->`)"
                )
            elif i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
                bad.append(f"{where}: the marker is not immediately followed by a ```bash fence")
            elif not any(line.strip() == "```" for line in lines[i + 2 :]):
                bad.append(f"{where}: the marked block is never closed")
    assert bad == [], "\n".join(bad)


def test_some_blocks_are_marked():
    assert len(BLOCKS) >= 3, [b.name for b in BLOCKS]


def _environment(tmp_path: pathlib.Path) -> dict[str, str]:
    home = tmp_path / "home"
    scratch = tmp_path / "tmp"
    home.mkdir()
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCOX_")}
    env.update(HOME=str(home), TMPDIR=str(scratch))
    # `dilocox` and `python3` of the interpreter running the tests come first (a venv that is not activated)
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_runnable_block_exits_zero(block, tmp_path):
    try:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.script],
            cwd=ROOT,
            env=_environment(tmp_path),
            capture_output=True,
            text=True,
            timeout=block.timeout_s * LOAD_ALLOWANCE,
        )
    except subprocess.TimeoutExpired as timeout:
        output = "".join(
            part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
            for part in (timeout.stdout, timeout.stderr)
        )
        pytest.fail(
            f"{block.name}: still running after {block.timeout_s * LOAD_ALLOWANCE} s\n--- block "
            f"---\n{block.script}--- output ---\n{output[-4000:]}"
        )
    assert result.returncode == 0, (
        f"{block.name}: exit {result.returncode}\n--- block ---\n{block.script}"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
