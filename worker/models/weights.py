"""Continue pre-training from local weights: a `.safetensors` file (as `dilocox export` or Hugging Face's
`save_pretrained` write it) loaded into the freshly built model, every parameter checked by name and shape.
A sharded model reads only its own rows of each tensor: no rank holds the file's whole model."""

from __future__ import annotations

import pathlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dilocox.worker.models.materialize import local_rows
from dilocox.worker.models.spec import ModelSpecError


def load_weights(model: nn.Module, path: str) -> None:
    file = pathlib.Path(path).expanduser()
    if file.is_dir():
        file = file / "model.safetensors"
    if not file.is_file():
        raise ModelSpecError(f"--weights {path}: {file} does not exist")
    try:
        from safetensors import safe_open
    except ImportError:
        raise ModelSpecError("--weights needs the safetensors package: pip install safetensors") from None
    try:
        reader = safe_open(str(file), framework="pt")
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise ModelSpecError(f"--weights {file}: not a readable safetensors file: {error}") from None
    with reader:
        stored = set(reader.keys())
        params = dict(model.named_parameters())
        missing = [name for name in params if name not in stored]
        if missing:
            raise ModelSpecError(
                f"--weights {file}: no tensor for {len(missing)} of the model's {len(params)} parameters, "
                f"e.g. {', '.join(missing[:3])}"
            )
        shapes = {n: tuple(reader.get_slice(n).get_shape()) for n in params}
        wrong = [f"{n} {shapes[n]} vs {tuple(p.shape)}" for n, p in params.items() if shapes[n] != tuple(p.shape)]
        if wrong:
            raise ModelSpecError(f"--weights {file}: shapes differ from the model's: {'; '.join(wrong[:3])}")
        with torch.no_grad():
            for name, p in params.items():
                # Only the rows this rank holds are read (a sharded parameter's Shard(0) chunk).
                local = p.to_local() if isinstance(p, DTensor) else p
                if p.dim() == 0:
                    local.copy_(reader.get_tensor(name).to(torch.float32))
                    continue
                rows = local_rows(p)
                local.copy_(reader.get_slice(name)[rows.start : rows.stop].to(torch.float32))
