"""Tokenizers: byte-level (the default), a byte-level BPE trained on the run's data, or a `tokenizer.json`.

`--tokenizer byte`: bytes are tokens (vocabulary 256), nothing to train or ship. `--tokenizer bpe:VOCAB`
trains a byte-level BPE with Hugging Face `tokenizers` on (up to 64 MB of) the training data; the result
is cached under `$DILOCOX_CACHE_DIR` (default `~/.cache/dilocox`) by a digest of the data's content, so
every cluster of a run that sees the same data reuses one file instead of training its own — and the
training itself is deterministic, so two sites with the same data also get the same tokenizer.
A path loads a `tokenizer.json` as it is. A digest of the tokenizer's definition travels with prepared
token files, so data made with another tokenizer than the run's is refused.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from dilocox.common.atomic_file import write_text_atomic
from dilocox.common.wire.assignment import tokenizer_digest_of
from dilocox.worker.data.manifest import is_prepared, read_manifest
from dilocox.worker.data.sources import default_corpus_path, input_files, sample_text

BPE_SAMPLE_BYTES = 64 * 1024 * 1024
ENCODE_PART_CHARS = 16 * 1024
END_OF_TEXT = "<|endoftext|>"
INSTALL_HINT = "pip install 'dilocox[models]'"


class TokenizerError(ValueError):
    """A tokenizer that cannot be made or used: a bad spec, a missing file, a vocabulary that does not fit."""


class Tokenizer(Protocol):
    spec: str  # as the run names it: "byte", "bpe:8192", or a path
    vocab_size: int
    digest: str  # identifies the tokenizer's definition; prepared data records it
    separator: np.ndarray  # tokens put between two documents

    def encode(self, piece: bytes | str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id: uint8 for bytes, uint16 up to 65,536, else uint32."""
    if vocab_size <= 256:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


class ByteTokenizer:
    """Bytes are tokens: any file is a corpus; documents are joined by a newline, as the corpus always was."""

    spec = "byte"
    vocab_size = 256
    digest = "byte"
    separator = np.frombuffer(b"\n", dtype=np.uint8)

    def encode(self, piece: bytes | str) -> np.ndarray:
        data = piece.encode("utf-8") if isinstance(piece, str) else piece
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`; documents are separated by its end-of-text token if it has one."""

    def __init__(self, tokenizer, spec: str) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.definition = tokenizer.to_str()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.digest = tokenizer_digest_of(self.definition)
        self.dtype = token_dtype(self.vocab_size)
        eot = tokenizer.token_to_id(END_OF_TEXT)
        self.separator = np.array([] if eot is None else [eot], dtype=self.dtype)

    def encode(self, piece: bytes | str) -> np.ndarray:
        """Long text is cut after newlines into ~16 KB parts encoded as one batch (on all cores; the
        byte-level pre-tokenizer never merges across a newline run's end, so the ids are the same)."""
        text = piece.decode("utf-8", errors="replace") if isinstance(piece, bytes) else piece
        parts = _cut_after_newlines(text, ENCODE_PART_CHARS)
        encoded = self.tokenizer.encode_batch(parts, add_special_tokens=False)
        return np.fromiter((i for e in encoded for i in e.ids), dtype=self.dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def save(self, path: str | os.PathLike) -> None:
        write_text_atomic(pathlib.Path(path), self.definition)


def _cut_after_newlines(text: str, size: int) -> list[str]:
    parts, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n", start + size) + 1
        if cut == 0:
            break
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return parts


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            f"BPE and tokenizer.json need the Hugging Face tokenizers package: {INSTALL_HINT}"
        ) from None
    return tokenizers


def load_tokenizer_file(path: str | os.PathLike, spec: str | None = None) -> HFTokenizer:
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise TokenizerError(f"tokenizer file does not exist: {p}")
    return load_tokenizer_text(p.read_text(), spec or str(path), where=str(p))


def load_tokenizer_text(definition: str, spec: str, where: str = "the tokenizer") -> HFTokenizer:
    """A tokenizer from its `tokenizer.json` text (a file's, or the one a run's shards recorded)."""
    tokenizers = _tokenizers()
    try:
        tokenizer = tokenizers.Tokenizer.from_str(definition)
    except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise TokenizerError(f"{where} is not a Hugging Face tokenizer.json: {error}") from None
    return HFTokenizer(tokenizer, spec)


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DILOCOX_CACHE_DIR") or pathlib.Path.home() / ".cache" / "dilocox")


def data_digest(path: str | os.PathLike) -> str:
    """sha256 over the data's files (relative names and contents, in their sorted order)."""
    root = pathlib.Path(path)
    h = hashlib.sha256()
    for file in input_files(root):
        h.update((file.relative_to(root).as_posix() if root.is_dir() else file.name).encode() + b"\0")
        with file.open("rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int, spec: str) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style: no unknown tokens, every byte representable) with `<|endoftext|>`."""
    tokenizers = _tokenizers()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer, spec)


def bpe_vocab(spec: str) -> int:
    text = spec.partition(":")[2]
    if not text.isdigit() or not 257 < int(text) < 2**32:
        raise TokenizerError(f"--tokenizer {spec}: bpe:VOCAB needs a vocabulary size above 257 (e.g. bpe:8192)")
    return int(text)


def resolve_tokenizer(spec: str, data: str | os.PathLike | None = None, text_field: str = "text") -> Tokenizer:
    """The run's tokenizer. `bpe:VOCAB` needs the training data: a text path (trained on it, or found in
    the cache), or a prepared token folder (its own `tokenizer.json`, which must be a `bpe:VOCAB` one)."""
    spec = (spec or "byte").strip()
    if spec == "byte":
        return ByteTokenizer()
    if not spec.startswith("bpe:"):
        return load_tokenizer_file(spec)
    vocab = bpe_vocab(spec)
    data = default_corpus_path() if data is None else pathlib.Path(data)
    if is_prepared(data):
        manifest = read_manifest(data)
        if manifest.tokenizer_spec != spec:
            raise TokenizerError(
                f"--tokenizer {spec}: the data in {data} was prepared with --tokenizer {manifest.tokenizer_spec}"
            )
        return load_tokenizer_file(data / "tokenizer.json", spec)
    cached = cache_dir() / "tokenizers" / f"bpe{vocab}-{data_digest(data)[:24]}.json"
    if cached.is_file():
        return load_tokenizer_file(cached, spec)
    tokenizer = train_bpe(sample_text(data, text_field, BPE_SAMPLE_BYTES), vocab, spec)
    tokenizer.save(cached)
    return tokenizer
