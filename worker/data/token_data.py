"""A run's training and eval tokens: a prepared token file streamed from disk, or text tokenised on the fly.

`dilocox data prepare` writes a folder (worker/data/manifest.py); a worker reads only the windows it
samples from its `tokens.bin` (worker/data/token_file.py), so a corpus far larger than RAM costs a
worker no more memory than a small one. A plain text path (file or folder, `.jsonl`, `.parquet`) is
tokenised into memory at start-up — the same stream `data prepare` writes — which suits corpora of a
few hundred MB at most.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dilocox.worker.data.manifest import TOKENS_FILE, is_prepared, read_manifest
from dilocox.worker.data.sources import CorpusError, default_corpus_path, documents
from dilocox.worker.data.token_file import TokenFile
from dilocox.worker.data.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, resolve_tokenizer, token_dtype

EVAL_FRACTION = 0.1  # the last 10% of the tokens, unless a prepared folder says otherwise


@dataclass(frozen=True)
class TokenData:
    train: np.ndarray | TokenFile  # 1-D token ids, in memory or streamed from a prepared file
    eval: np.ndarray | TokenFile
    vocab_size: int
    tokenizer_digest: str
    source: str
    streamed: bool = False  # read window by window from a prepared token file
    tokenizer_json: str = ""  # the tokenizer's definition ("" for byte): the shards keep the run's for export

    @property
    def num_tokens(self) -> int:
        return len(self.train) + len(self.eval)

    @classmethod
    def from_tokens(
        cls, tokens: np.ndarray, tokenizer: Tokenizer, source: str, eval_fraction: float = EVAL_FRACTION
    ) -> TokenData:
        """Split in memory: eval is the LAST eval_fraction, a contiguous held-out text no window overlaps."""
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        split = len(tokens) - int(len(tokens) * eval_fraction)
        return cls(
            tokens[:split],
            tokens[split:],
            tokenizer.vocab_size,
            tokenizer.digest,
            source,
            tokenizer_json=getattr(tokenizer, "definition", ""),
        )

    @classmethod
    def from_bytes(cls, data: bytes, eval_fraction: float = EVAL_FRACTION) -> TokenData:
        """A byte-level corpus already in memory (tests, benchmarks, the default sim's corpus)."""
        tokens = np.frombuffer(bytearray(data), dtype=np.uint8)
        return cls.from_tokens(tokens, ByteTokenizer(), "<bytes>", eval_fraction)


def token_stream(
    path: str | os.PathLike, tokenizer: Tokenizer, text_field: str = "text"
) -> Iterator[tuple[np.ndarray, int, bool]]:
    """(token ids, bytes of text consumed, whether a new document starts here) piece by piece,
    documents joined by the tokenizer's separator. For the byte tokenizer on text files this is exactly
    the files' bytes joined by a newline, the corpus as it always was."""
    first = True
    for _file, pieces in documents(path, text_field):
        starts = True
        if not first:
            yield tokenizer.separator, 0, True
            starts = False
        first = False
        for piece in pieces:
            yield tokenizer.encode(piece), len(piece), starts
            starts = False


def open_prepared(path: str | os.PathLike, tokenizer: Tokenizer) -> TokenData:
    folder = pathlib.Path(path)
    manifest = read_manifest(folder)
    if manifest.tokenizer_digest != tokenizer.digest:
        raise TokenizerError(
            f"the data in {folder} was prepared with tokenizer {manifest.tokenizer_spec} "
            f"({manifest.tokenizer_digest[:19]}…), "
            f"the run uses {tokenizer.spec} ({tokenizer.digest[:19]}…): prepare it again with the run's --tokenizer"
        )
    if manifest.vocab_size > tokenizer.vocab_size:
        raise TokenizerError(
            f"the data in {folder} holds ids up to {manifest.vocab_size - 1}, beyond the tokenizer's vocabulary"
        )
    tokens = TokenFile(folder / TOKENS_FILE, np.dtype(manifest.dtype))
    split = manifest.train_tokens
    return TokenData(
        tokens[:split],
        tokens[split:],
        tokenizer.vocab_size,
        tokenizer.digest,
        str(folder),
        streamed=True,
        tokenizer_json=getattr(tokenizer, "definition", ""),
    )


def load_token_data(path: str | os.PathLike | None, tokenizer: Tokenizer, text_field: str = "text") -> TokenData:
    """The run's tokens from a prepared folder (streamed) or a text path (tokenised into memory)."""
    source = default_corpus_path() if path is None else pathlib.Path(path)
    if is_prepared(source):
        return open_prepared(source, tokenizer)
    pieces = [ids for ids, _size, _new in token_stream(source, tokenizer, text_field)]
    tokens = (
        np.concatenate(pieces).astype(token_dtype(tokenizer.vocab_size), copy=False)
        if pieces
        else np.zeros(0, np.uint8)
    )
    if len(tokens) == 0:
        raise CorpusError(f"corpus at {source} holds no text")
    return TokenData.from_tokens(tokens, tokenizer, str(source))


def run_tokenizer_spec(spec: str, path: str | os.PathLike | None) -> str:
    """The run's tokenizer: `spec` — or, where that is the default (byte) and `path` is a folder that
    `dilocox data prepare` made with another tokenizer, that folder's own (a site given prepared data
    needs no --tokenizer; the shards then check that every site's is the same)."""
    if spec != "byte" or path is None or not is_prepared(path):
        return spec
    manifest = read_manifest(path)
    if manifest.tokenizer_digest == "byte":
        return spec
    return (
        manifest.tokenizer_spec
        if manifest.tokenizer_spec.startswith("bpe:")
        else str(pathlib.Path(path) / "tokenizer.json")
    )


def load_run_data(tokenizer_spec: str, path: str | os.PathLike | None, text_field: str = "text") -> TokenData:
    """A worker's data: the run's tokenizer (trained or found in the cache for `bpe:VOCAB`), then its tokens."""
    return load_token_data(path, resolve_tokenizer(tokenizer_spec, path, text_field), text_field)


def add_data_arguments(parser: argparse.ArgumentParser, data_help: str | None = None) -> None:
    """`--data` and `--text-field`, as every command that reads a run's data takes them."""
    parser.add_argument(
        "--data",
        help=data_help
        or "a folder made by `dilocox data prepare` (streamed from disk), or a text "
        "file, folder, .jsonl or .parquet tokenised at start-up (default: the bundled tinyshakespeare)",
    )
    parser.add_argument(
        "--text-field", default="text", help="the text field of .jsonl records / .parquet column (default text)"
    )
