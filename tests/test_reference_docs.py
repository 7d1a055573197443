"""docs/reference.md is what the parsers render now, it lists every flag `--help` shows, and the docs' links resolve.

The reference is generated (common/config/cli_reference.py) so that it cannot drift from the code; these
tests are what makes "cannot" true: a flag added without regenerating fails here with the command to
run. The link check covers README.md and docs/*.md because a renamed heading or moved file otherwise
breaks a link without anyone noticing.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from dilocox.common import cli
from dilocox.common.config import cli_reference
from dilocox.common.config.sources import subparsers_of

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference.md"
SAMPLED = [
    ["worker"],
    ["server"],
    ["sim"],
    ["plan"],
    ["export"],
    ["bench", "gpu"],
    ["deploy", "slurm"],
    ["compose", "check"],
]


@pytest.fixture(scope="module")
def rendered() -> str:
    return cli_reference.render()


def test_committed_reference_is_current(rendered):
    reason = cli_reference.stale(REFERENCE, rendered)
    assert reason is None, f"{reason} (run it from the repository root, then commit docs/reference.md)"


def test_rendering_does_not_depend_on_the_machine(rendered, tmp_path, monkeypatch):
    """Another directory, home and terminal width render the same file: defaults computed from the
    current or home directory (compose's --project-dir, --cache-dir) come out as `.` and `~`."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("COLUMNS", "40")
    elsewhere = cli_reference.render()
    assert elsewhere == rendered
    for leak in (str(ROOT), str(tmp_path), str(pathlib.Path.home())):
        assert leak not in rendered
    assert not re.search(r"(?<![\w.])/(work|tmp|root|home|Users)/", rendered), "an absolute path in the reference"


def _help_options(path: list[str]) -> list[str]:
    """Every option string on the invocation lines of `dilocox <path> --help` (`  -h, --help`, `  --x X`)."""
    parser = subparsers_of(cli.build_parser(path))[path[0]]
    if len(path) > 1:
        parser = subparsers_of(parser)[path[1]]
    options = []
    for line in parser.format_help().splitlines():
        if re.match(r"^  -", line):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            options += [part.split()[0] for part in invocation.split(", ") if part.startswith("-")]
    assert options, f"no options parsed from dilocox {' '.join(path)} --help"
    return options


@pytest.mark.parametrize("path", SAMPLED, ids=" ".join)
def test_every_option_of_help_is_in_its_section(path):
    sections = cli_reference.sections(REFERENCE.read_text())
    title = "dilocox " + " ".join(path)
    assert title in sections, f"docs/reference.md has no section for `{title}`"
    missing = [o for o in _help_options(path) if f"`{o}`" not in sections[title]]
    assert missing == [], f"`{title} --help` shows {missing}, absent from its section in docs/reference.md"


def test_check_names_the_stale_command(tmp_path, capsys):
    out = tmp_path / "reference.md"
    assert cli.main(["docs", "reference", "--out", str(out)]) == 0
    assert cli.main(["docs", "reference", "--check", "--out", str(out)]) == 0
    text = out.read_text()
    out.write_text(text.replace("| `--servers` | `SERVERS` | required |", "| `--servers` | `SERVERS` | — |", 1))
    assert cli.main(["docs", "reference", "--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "`dilocox worker`" in err and "dilocox docs reference" in err, err


# --- links in README.md and docs/*.md ---------------------------------------------------------------


def _without_code(text: str) -> str:
    """The text outside fenced blocks and code spans (a link written in code is not a link)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        kept.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives `text`'s headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated heading suffixed -1, -2, …"""
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in text.splitlines():
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
        match = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"<[^>]+>", "", match.group(1))
        title = re.sub(r"(?<!\w)[_*]+|[_*]+(?!\w)", "", title)  # emphasis markers, not intra-word underscores
        base = cli_reference.slug(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def _link_targets(text: str) -> list[str]:
    body = _without_code(text)
    inline = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", body)
    definitions = re.findall(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", body, flags=re.M)
    return inline + definitions


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("document", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    broken = []
    for target in _link_targets(document.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        file = (document.parent / path_part).resolve() if path_part else document
        if not file.exists():
            broken.append(f"{target}: no file {path_part}")
        elif anchor and file.suffix == ".md" and anchor.lower() not in github_anchors(file.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert broken == [], f"{document.relative_to(ROOT)}: broken links: {broken}"


def test_anchor_rule_matches_github():
    anchors = github_anchors("# A `dilocox bench wan` run\n## Why? (and how)\n## Why? (and how)\n## snake_case_name\n")
    assert anchors == {"a-dilocox-bench-wan-run", "why-and-how", "why-and-how-1", "snake_case_name"}
