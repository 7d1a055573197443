"""Where training text comes from: a text file, a folder of files, `.jsonl` records or `.parquet` rows.

Documents are streamed in pieces of a few MB, never a whole corpus at once, so `dilocox data prepare`
runs in bounded memory on corpora far larger than RAM. A folder is walked recursively in sorted relative
POSIX path order (the order must not depend on the filesystem), skipping hidden files and folders.
Plain text is yielded as bytes (the byte tokenizer takes them as they are); `.jsonl` and `.parquet`
records as str (their named text field).
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib
from collections.abc import Iterator

PIECE_BYTES = 4 * 1024 * 1024  # a text file is read in pieces of about this size, cut after a newline
STRUCTURED = (".jsonl", ".parquet")


class CorpusError(ValueError):
    """Training data that cannot be used: missing, empty, a bad record or field, too small for the split."""


def default_corpus_path() -> pathlib.Path:
    """The bundled tinyshakespeare, so that `dilocox sim` works with no data argument."""
    return pathlib.Path(str(importlib.resources.files("dilocox.common") / "data" / "tinyshakespeare.txt"))


def _is_hidden(rel: pathlib.PurePath) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def input_files(path: str | os.PathLike) -> list[pathlib.Path]:
    """The files a path stands for: itself, or every regular, non-hidden file under a folder, sorted."""
    p = pathlib.Path(path)
    if not p.exists():
        raise CorpusError(f"corpus path does not exist: {p}")
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise CorpusError(f"corpus path is neither a regular file nor a folder: {p}")
    files: list[tuple[str, pathlib.Path]] = []
    for root, dirs, names in os.walk(p):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            full = pathlib.Path(root) / name
            rel = full.relative_to(p)
            if not _is_hidden(rel) and full.is_file():
                files.append((rel.as_posix(), full))
    files.sort(key=lambda item: item[0])
    if not files:
        raise CorpusError(f"corpus folder has no non-empty, non-hidden regular files: {p}")
    return [full for _, full in files]


def text_pieces(path: pathlib.Path) -> Iterator[bytes]:
    """A text file in pieces of about PIECE_BYTES, each cut just after a newline where there is one."""
    carry = b""
    with path.open("rb") as f:
        while True:
            block = f.read(PIECE_BYTES)
            if not block:
                break
            block = carry + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                carry = block
                continue
            carry = block[cut:]
            yield block[:cut]
    if carry:
        yield carry


def jsonl_records(path: pathlib.Path, field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"{path}:{number}: not a JSON record: {error}") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise CorpusError(f"{path}:{number}: no text field {field!r} (use --text-field to name it)")
            yield text


def parquet_records(path: pathlib.Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path}: reading .parquet needs pyarrow: pip install 'dilocox[data]'") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises ArrowInvalid and friends for a bad file
        raise CorpusError(f"{path}: not a readable parquet file: {error}") from None
    if field not in table.schema_arrow.names:
        raise CorpusError(
            f"{path}: no column {field!r} (columns: {', '.join(table.schema_arrow.names)}; use --text-field)"
        )
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield str(text)


def documents(path: str | os.PathLike, field: str = "text") -> Iterator[tuple[pathlib.Path, Iterator[bytes | str]]]:
    """(file, its pieces) for every input: a text file is one document in pieces; every `.jsonl` line
    and every `.parquet` row is a document of its own (one piece)."""
    for file in input_files(path):
        suffix = file.suffix.lower()
        if suffix == ".jsonl":
            for text in jsonl_records(file, field):
                yield file, iter((text,))
        elif suffix == ".parquet":
            for text in parquet_records(file, field):
                yield file, iter((text,))
        else:
            yield file, text_pieces(file)


def sample_text(path: str | os.PathLike, field: str, limit_bytes: int) -> Iterator[str]:
    """Up to `limit_bytes` of the data's text, from the start, in pieces (what a BPE is trained on)."""
    taken = 0
    for _file, pieces in documents(path, field):
        for piece in pieces:
            text = piece.decode("utf-8", errors="replace") if isinstance(piece, bytes) else piece
            yield text
            taken += len(text)
            if taken >= limit_bytes:
                return
