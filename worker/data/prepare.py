"""`dilocox data prepare`: tokenise text files, folders, `.jsonl` and `.parquet` into a token file plus
its manifest, in bounded memory, with a progress bar; `dilocox data info` prints one.

The folder appears whole or not at all (common/atomic_file.py's `atomic_folder`): an interrupted or
failed run leaves no half-written output.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from dilocox.common.atomic_file import atomic_folder
from dilocox.worker.data.manifest import MANIFEST_FILE, TOKENS_FILE, Manifest, is_prepared, read_manifest
from dilocox.worker.data.sources import CorpusError, input_files
from dilocox.worker.data.token_data import EVAL_FRACTION, token_stream
from dilocox.worker.data.tokenizer import HFTokenizer, Tokenizer, TokenizerError, resolve_tokenizer, token_dtype


def prepare_tokens(
    data: str | os.PathLike,
    tokenizer: Tokenizer,
    out: str | os.PathLike,
    text_field: str = "text",
    eval_fraction: float = EVAL_FRACTION,
    progress: bool = False,
) -> Manifest:
    """Write `out/tokens.bin`, `out/manifest.json` (and `out/tokenizer.json`); returns the manifest."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval fraction must be in (0, 1), got {eval_fraction}")
    files = input_files(data)
    dtype = token_dtype(tokenizer.vocab_size)
    structured = any(f.suffix.lower() == ".parquet" for f in files)  # compressed: its text outgrows the file
    bar = _progress(None if structured else sum(f.stat().st_size for f in files), progress)
    try:
        with atomic_folder(out) as partial:
            count = documents = 0
            with (partial / TOKENS_FILE).open("wb") as sink:
                for ids, consumed, new_document in token_stream(data, tokenizer, text_field):
                    documents += new_document
                    sink.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
                    count += len(ids)
                    bar.update(consumed)
                sink.flush()
                os.fsync(sink.fileno())
            eval_tokens = int(count * eval_fraction)
            if eval_tokens < 2 or count - eval_tokens < 2:
                raise CorpusError(
                    f"corpus too small for the split: {count} tokens give {count - eval_tokens} to train and "
                    f"{eval_tokens} to evaluate (eval fraction {eval_fraction})"
                )
            manifest = Manifest(
                dtype=dtype.name,
                num_tokens=count,
                eval_tokens=eval_tokens,
                tokenizer_spec=tokenizer.spec,
                tokenizer_digest=tokenizer.digest,
                vocab_size=tokenizer.vocab_size,
                documents=documents,
                sources=[str(f) for f in files],
                text_field=text_field,
            )
            if isinstance(tokenizer, HFTokenizer):
                tokenizer.save(partial / "tokenizer.json")
            (partial / MANIFEST_FILE).write_text(manifest.to_json())
        return manifest
    except FileExistsError as error:
        raise CorpusError(str(error)) from None
    finally:
        bar.close()


def _progress(total: int | None, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenising", disable=not enabled, file=sys.stderr)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenise text, a folder, .jsonl or .parquet into a token file + manifest",
        description="Tokenise a corpus into OUT/tokens.bin + OUT/manifest.json for `--data OUT`.",
    )
    prep.add_argument("input", help="a text file, a folder (recursive), a .jsonl or a .parquet file")
    prep.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    prep.add_argument(
        "--tokenizer", default="byte", help="byte (default), bpe:VOCAB (trained on the input), or a tokenizer.json"
    )
    prep.add_argument(
        "--text-field", default="text", help="the text field of .jsonl records / .parquet column (default text)"
    )
    prep.add_argument(
        "--eval-fraction",
        type=float,
        default=EVAL_FRACTION,
        help=f"held-out share, the last tokens (default {EVAL_FRACTION})",
    )
    prep.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none either where stderr is not a "
        "terminal: a log file gets no carriage-return redraws)",
    )
    info = actions.add_parser("info", help="print a prepared folder's manifest")
    info.add_argument("folder")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "info":
            print(read_manifest(args.folder).to_json(), end="")
            return 0
        if is_prepared(args.input):
            raise CorpusError(f"{args.input} is already a prepared token folder")
        tokenizer = resolve_tokenizer(args.tokenizer, args.input, args.text_field)
        manifest = prepare_tokens(
            args.input,
            tokenizer,
            args.out,
            args.text_field,
            args.eval_fraction,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
    except (CorpusError, TokenizerError, ValueError) as error:
        print(f"dilocox data {args.action}: {error}", file=sys.stderr)
        return 1
    print(
        f"prepared {manifest.num_tokens:,} tokens ({manifest.dtype}, {manifest.documents:,} documents; "
        f"eval: the last {manifest.eval_tokens:,}) with tokenizer {manifest.tokenizer_spec} in {args.out}"
    )
    return 0
