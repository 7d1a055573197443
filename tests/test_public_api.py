"""The public surface: `from dilocox import …` gives exactly the names docs/api.md documents,
each resolves, importing `dilocox` loads nothing heavy, and `load_run_config` reads the CLI's files."""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import dilocox
from dilocox.common.config.run import InnerConfig, RunConfig
from dilocox.common.config.sources import SettingsError

API_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "api.md"


def _documented() -> set[str]:
    names: set[str] = set()
    for heading in re.findall(r"^### (.+)$", API_PAGE.read_text(), re.M):
        names.update(re.findall(r"`(\w+)`", heading))
    return names


def test_exported_names_are_exactly_the_documented_ones():
    assert set(dilocox.__all__) == _documented()
    for name in dilocox.__all__:
        assert getattr(dilocox, name) is not None, name
    with pytest.raises(AttributeError):
        dilocox.DilocoCluster  # internal: not reachable from the top  # noqa: B018


def test_every_argument_of_the_site_is_documented():
    page = API_PAGE.read_text()
    arguments = [n for n in inspect.signature(dilocox.DiLoCoX).parameters if n != "builtin"]
    assert [name for name in arguments if f"| `{name}` |" not in page] == []  # a row of the argument table each


def test_importing_dilocox_loads_neither_torch_nor_grpc():
    code = "import sys, dilocox; print(sorted(m for m in ('torch', 'grpc', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_load_run_config_reads_a_cli_config_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'run-id = "shared"\nrounds = 7\nservers = "10.0.0.5:50051"\n\n[inner]\nsteps = 12\n\n'
        '[worker]\ncluster = "site-a"\ninner-lr = 0.002\n\n[server]\nport = 50051\n'
    )
    config = dilocox.load_run_config(path)
    assert config == RunConfig(run_id="shared", rounds=7, inner=InnerConfig(steps=12, lr=0.002))
    path.write_text("rounds = 7\nround = 3\n")
    with pytest.raises(SettingsError, match="unknown key 'round'"):
        dilocox.load_run_config(path)
