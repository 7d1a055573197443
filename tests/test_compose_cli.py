"""`dilocox compose`: where docker cannot be had, `check` (run by CI) skips loudly and passes, while
`build` (asked for by a person) fails with the reason; `render --check` spots a stale file."""

from __future__ import annotations

import pathlib

import pytest
import structlog

from dilocox.common.cli import build_parser
from dilocox.common.deploy import compose_images
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
    monkeypatch.setattr(compose_images, "engine_answers", lambda: False)
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


def test_the_offline_recipe_installs_the_documented_extras():
    """The image carries what docs/deploy.md's examples run (--model llama-*, bpe: tokenizers): the
    Dockerfile's default EXTRAS and the offline recipe's agree and include models."""
    recipe = compose_images.recipe_for("cpu")
    args = recipe.build_args()
    assert args == {"BASE_IMAGE": compose_images.BASE_IMAGE, "EXTRAS": "models,tracking", "WHEELHOUSE": ".wheelhouse"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert (
        f'ARG EXTRAS="{compose_images.DEFAULT_EXTRAS}"' in dockerfile
        and "models" in compose_images.DEFAULT_EXTRAS.split(",")
    )
    declared = {line.split()[1].split("=")[0] for line in dockerfile.splitlines() if line.startswith("ARG ")}
    cuda = compose_images.recipe_for("cuda").build_args()
    assert set(args) | set(cuda) <= declared, "every build argument a recipe passes is one the Dockerfile reads"


def test_the_cuda_variant_is_printed_not_built(monkeypatch, capsys):
    """No CUDA torch is ever fetched here: `build --variant cuda` prints the registry recipe and touches
    no engine; the torch it names is the host's version from PyTorch's CUDA index."""
    monkeypatch.setattr(
        "dilocox.common.deploy.compose_cli.ensure_engine", lambda: pytest.fail("the engine was touched")
    )
    assert run(args_of("build", "--variant", "cuda", "--extras", "models, data")) == 0
    out = capsys.readouterr()
    command = out.out.strip().splitlines()[-1]
    host = compose_images.host_torch_version()
    assert "+" not in host
    assert command == (
        f"docker build --tag dilocox:cuda --build-arg BASE_IMAGE={compose_images.CUDA_BASE_IMAGE} --build-arg "
        f"EXTRAS=models,data --build-arg TORCH_INDEX_URL={compose_images.CUDA_TORCH_INDEX} --build-arg "
        f"TORCH_VERSION={host} {ROOT}"
    )
    assert "not built here" in out.err
    assert (
        run(
            args_of(
                "build",
                "--variant",
                "cuda",
                "--torch-index",
                "https://download.pytorch.org/whl/cu128",
                "--base-image",
                "nvidia/cuda:12.8.1-runtime-ubuntu24.04",
                "--print",
            )
        )
        == 0
    )
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert (
        "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128" in command
        and "BASE_IMAGE=nvidia/cuda:12.8.1" in command
    )
    assert run(args_of("build", "--print")) == 0  # the offline recipe's steps, nothing run
    assert "--build-arg WHEELHOUSE=.wheelhouse" in capsys.readouterr().out


def test_the_wheelhouse_resolves_the_extras_at_the_hosts_versions(monkeypatch, tmp_path):
    """The host's torch build and the host's versions of the extras' libraries, from the cache alone
    first (--no-index), the package index only for what the cache lacks."""
    import importlib.metadata

    project, cache, seen = tmp_path / "project", tmp_path / "cache", []
    project.mkdir()

    def fake_run(argv, timeout=600, **kwargs):
        if "wheel" in argv:
            (cache / "dilocox-0.1.0-py3-none-any.whl").write_text("")
        elif "download" in argv:
            pins = pathlib.Path(argv[argv.index("--constraint") + 1]).read_text().splitlines()
            seen.append((argv, pins))
            (project / ".wheelhouse" / "transformers-5.0-py3-none-any.whl").write_text("")
        return None

    monkeypatch.setattr(compose_images, "run", fake_run)
    target = compose_images.prepare_wheelhouse(project, cache, "models,tracking")
    ((argv, pins),) = seen
    assert "--no-index" in argv and f"{cache}/dilocox-0.1.0-py3-none-any.whl[models,tracking]" in argv
    assert f"torch=={importlib.metadata.version('torch')}" in argv
    assert f"transformers=={importlib.metadata.version('transformers')}" in pins and not any(
        p.startswith("dilocox==") for p in pins
    )
    assert (cache / "transformers-5.0-py3-none-any.whl").exists(), "new wheels are kept in the cache"
    assert [p.name for p in target.iterdir()] == ["transformers-5.0-py3-none-any.whl"]
