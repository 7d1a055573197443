"""`dilocox compose`: where docker cannot be had, `check` (run by CI) skips loudly and passes, while
`build` (asked for by a person) fails with the reason; `render --check` spots a stale file."""

from __future__ import annotations

import pathlib

import pytest
import structlog

from dilocox.common.deploy import compose_images
from dilocox.common.cli import build_parser
from dilocox.common.deploy.compose_cli import run

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def keep_logging():
    saved = structlog.get_config()  # run() points structlog at this test's captured stderr
    yield
    structlog.configure(**saved)


@pytest.fixture
def no_docker(monkeypatch):
    """A machine with no docker, no apt and no root: nothing can be installed."""
    monkeypatch.setattr(compose_images, "_engine_answers", lambda: False)
    monkeypatch.setattr(compose_images.shutil, "which", lambda tool: None)
    monkeypatch.setattr(compose_images.os, "geteuid", lambda: 1000)


def args_of(*argv: str):
    argv = ["compose", "--project-dir", str(ROOT), *argv]
    return build_parser(argv).parse_args(argv)


def test_check_skips_loudly_without_docker(no_docker, capsys):
    assert run(args_of("check")) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIPPED: docker compose simulation:") and "cannot be installed" in out


def test_build_fails_without_docker(no_docker, capsys):
    assert run(args_of("build")) == 1
    assert "dilocox compose build:" in capsys.readouterr().err


def test_render_check_spots_a_stale_file(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    (tmp_path / "docker-compose.yml").write_text("services: {}\n")
    argv = ["compose", "--project-dir", str(tmp_path), "render", "--check"]
    assert run(build_parser(argv).parse_args(argv)) == 1
    assert run(args_of("render", "--check")) == 0  # the committed file is current
