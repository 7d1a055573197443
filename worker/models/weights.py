"""Continue pre-training from local weights: a `.safetensors` file (as `dilocox export` or Hugging Face's
`save_pretrained` write it) loaded into the freshly built model, every parameter checked by name and shape."""

from __future__ import annotations

import pathlib

import torch
from torch import nn

from dilocox.worker.models.spec import ModelSpecError


def load_weights(model: nn.Module, path: str) -> None:
    file = pathlib.Path(path).expanduser()
    if file.is_dir():
        file = file / "model.safetensors"
    if not file.is_file():
        raise ModelSpecError(f"--weights {path}: {file} does not exist")
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ModelSpecError("--weights needs the safetensors package: pip install safetensors") from None
    try:
        state = load_file(str(file))
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise ModelSpecError(f"--weights {file}: not a readable safetensors file: {error}") from None
    params = dict(model.named_parameters())
    missing = [name for name in params if name not in state]
    if missing:
        raise ModelSpecError(f"--weights {file}: no tensor for {len(missing)} of the model's {len(params)} parameters, "
                             f"e.g. {', '.join(missing[:3])}")  # fmt: skip
    wrong = [f"{n} {tuple(state[n].shape)} vs {tuple(p.shape)}" for n, p in params.items() if tuple(state[n].shape) != tuple(p.shape)]
    if wrong:
        raise ModelSpecError(f"--weights {file}: shapes differ from the model's: {'; '.join(wrong[:3])}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(torch.float32))
