"""The manifest of a prepared token folder: what `tokens.bin` holds and which tokenizer made it.

A prepared folder is `tokens.bin` (the corpus' token ids back to back, uint8/uint16/uint32 by the
vocabulary; the last `eval_tokens` are the held-out eval split), `manifest.json`, and `tokenizer.json`
for a Hugging Face tokenizer. The tokenizer's digest is how a worker knows the data fits its run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from dilocox.worker.data.sources import CorpusError

FORMAT = "dilocox-tokens"
VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENS_FILE = "tokens.bin"


@dataclass(frozen=True)
class Manifest:
    dtype: str  # numpy name: uint8 | uint16 | uint32
    num_tokens: int
    eval_tokens: int  # the last eval_tokens of tokens.bin
    tokenizer_spec: str
    tokenizer_digest: str
    vocab_size: int
    documents: int
    sources: list[str]
    text_field: str = "text"
    format: str = FORMAT
    version: int = VERSION

    @property
    def train_tokens(self) -> int:
        return self.num_tokens - self.eval_tokens

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


def is_prepared(path: str | os.PathLike) -> bool:
    return (pathlib.Path(path) / MANIFEST_FILE).is_file()


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The folder's manifest, checked against its token file's size."""
    folder = pathlib.Path(path)
    file = folder / MANIFEST_FILE
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorpusError(f"{file}: not a readable manifest: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorpusError(f'{file}: not a dilocox token manifest (no "format": "{FORMAT}")')
    if data.get("version") != VERSION:
        raise CorpusError(f"{file}: manifest version {data.get('version')}, this dilocox reads version {VERSION}")
    names = {f.name for f in dataclasses.fields(Manifest)}
    try:
        manifest = Manifest(**{k: v for k, v in data.items() if k in names})
    except TypeError as error:
        raise CorpusError(f"{file}: incomplete manifest: {error}") from None
    tokens = folder / TOKENS_FILE
    expected = manifest.num_tokens * np.dtype(manifest.dtype).itemsize
    if not tokens.is_file() or tokens.stat().st_size != expected:
        size = tokens.stat().st_size if tokens.is_file() else "missing"
        raise CorpusError(
            f"{tokens}: {size} bytes, the manifest says {manifest.num_tokens} {manifest.dtype} tokens ({expected} "
            "bytes)"
        )
    return manifest
