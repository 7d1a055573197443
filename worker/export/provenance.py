"""`provenance.json`: where an exported model came from, written into every export folder, and the
step that signs the folder when the exporter has a key (worker/export/signing.py).

Why a record of its own beside `export.json`: export.json says what the model is (for loading and
`--eval`); provenance.json says where it came from — which run, which global version after how many
rounds, which tokenizer (by digest), the run's configuration, which shards or checkpoint files it was
read from, which dilocox and when — the digest of every exported file, and the shards' rounds chains up to
the exported version (`rounds_chain`, worker/export/chain.py). The signature covers its digest, so a
signed export's provenance cannot be edited unnoticed.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from dataclasses import asdict, dataclass, field

from dilocox.common.signing_keys import Signer
from dilocox.worker.export.openssf import sign_openssf
from dilocox.worker.export.signing import PROVENANCE_FILE, FileDigest, digest_files, sign_folder

PROVENANCE_FORMAT = "dilocox-provenance/1"


def dilocox_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dilocox")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Provenance:
    """The record written as provenance.json (its fields in this order)."""

    run_id: str
    version: int  # the global model version exported: rounds closed on the shards, the flush included
    rounds: int  # the run's configured rounds
    final_version: int  # the version the run ends on (rounds, plus one for the end-of-run flush)
    tokenizer_digest: str  # sha256 of the run's tokenizer.json, or "byte"
    run_config: dict  # the run's configuration as the shards recorded it (fields in use)
    source: dict  # {"servers": [host:port, ...]} or {"checkpoints": [file, ...]}
    files: list[FileDigest]  # every exported file but this record and the signature
    dilocox_version: str = field(default_factory=dilocox_version)
    exported_at: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    format: str = PROVENANCE_FORMAT
    rounds_chain: dict = field(default_factory=dict)  # each shard's rounds chain up to `version`; {} if none kept one

    def as_json(self) -> str:
        record = {"format": self.format, **{k: v for k, v in asdict(self).items() if k != "format"}}
        record["files"] = [f.as_dict() for f in self.files]
        if not self.rounds_chain:
            del record["rounds_chain"]
        return json.dumps(record, indent=2) + "\n"


def write_provenance(
    folder: pathlib.Path,
    run_id: str,
    version: int,
    rounds: int,
    final_version: int,
    tokenizer_digest: str,
    run_config: dict,
    source: dict,
    signer: Signer | None = None,
    rounds_chain: dict | None = None,
) -> Provenance:
    """Write provenance.json over the export in `folder` (its other files written), and sign the folder
    when there is a `signer`. Called inside the export's atomic folder: signed whole or not at all."""
    files = digest_files(folder)
    record = Provenance(
        run_id,
        version,
        rounds,
        final_version,
        tokenizer_digest,
        run_config,
        source,
        files,
        rounds_chain=rounds_chain or {},
    )
    (folder / PROVENANCE_FILE).write_text(record.as_json())
    if signer is not None:
        sign_folder(folder, signer, files)
        sign_openssf(folder, signer)  # last: over every file, ours included (where model-signing is installed)
    return record
