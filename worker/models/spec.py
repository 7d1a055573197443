"""What `--model` names: the built-in GPT, a shipped preset or a Hugging Face `config.json`, or a
`module:function` entry. Resolution only reads files; building is worker/models/build.py."""

from __future__ import annotations

import importlib.resources
import json
import pathlib
from dataclasses import dataclass

BUILTIN = "gpt"


class ModelSpecError(ValueError):
    """`--model` names nothing usable: an unknown preset, a missing or malformed config.json, a bad entry."""


@dataclass(frozen=True)
class ModelSpec:
    """A resolved `--model`: which builder, and what it needs."""

    kind: str  # "gpt" | "hf" | "entry"
    label: str  # as given on the command line, for logs and errors
    hf_config: dict | None = None  # the config.json contents (kind "hf")
    from_preset: bool = False  # presets take the tokenizer's vocabulary; a user's config.json keeps its own
    entry: str = ""  # "module:function" (kind "entry")


def presets_dir() -> pathlib.Path:
    return pathlib.Path(str(importlib.resources.files("dilocox.worker.models") / "presets"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.json"))


def _read_config_json(path: pathlib.Path, label: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ModelSpecError(f"--model {label}: cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise ModelSpecError(f"--model {label}: {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelSpecError(f'--model {label}: {path} is not a Hugging Face model configuration (no "model_type")')
    return data


def resolve_model(name: str) -> ModelSpec:
    """`gpt`, a preset name, a path to a config.json (or a folder holding one), or `module:function`."""
    name = name.strip()
    if name in ("", BUILTIN):
        return ModelSpec("gpt", BUILTIN)
    if name in preset_names():
        return ModelSpec("hf", name, _read_config_json(presets_dir() / f"{name}.json", name), from_preset=True)
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ModelSpecError(f"--model {name}: {path} does not exist")
        return ModelSpec("hf", name, _read_config_json(path, name))
    if ":" in name:
        module, _, function = name.partition(":")
        if module and function.isidentifier():
            return ModelSpec("entry", name, entry=name)
    raise ModelSpecError(
        f"--model {name!r} is not a known model: use {BUILTIN} (built-in), a preset ({', '.join(preset_names())}), "
        "a path to a Hugging Face config.json, or module:function"
    )
