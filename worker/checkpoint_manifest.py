"""A site checkpoint's integrity: each rank seals what it wrote, rank 0 commits the folder.

A 70B site's checkpoint is over a terabyte. Re-reading and hashing all of it on rank 0, on one thread, took
~14 minutes, and pruning waited behind it, so with short rounds checkpoints piled up. Now:

* **`COMMITTED`** (rank 0, at the commit, in the training thread): the round and every file of the folder
  with its size — a listing, no read — and the seal each rank of the site will write. It is written
  durably (fsync, rename, fsync of the folder) and older checkpoints are pruned at once.
* **`SEAL-rank<r>.json`** (every rank, in a thread of its own, after its part is written): the SHA-256 of
  the files that rank wrote — DCP's `__<r>_<i>.distcp`, its replica file, and on rank 0 DCP's
  `.metadata` — so the site hashes in parallel and each rank reads back only its own bytes.

`verify` (at `--resume`) checks every listed size, and every hash of every seal present. A seal missing
(the run stopped while that rank was still hashing) leaves those files checked by size only, said in a
warning; a damaged file or a wrong size refuses the checkpoint, and the site falls back to an older one.
A format-1 `COMMITTED` (rank 0 hashed every file itself) is still verified as such.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re

import structlog

from dilocox.common.atomic_file import write_text_atomic

log = structlog.get_logger()

COMMITTED = "COMMITTED"
MANIFEST_FORMAT = "dilocox-site-checkpoint/2"
MANIFEST_FORMAT_1 = "dilocox-site-checkpoint/1"  # every file's SHA-256 in COMMITTED itself, by rank 0
SEAL_FORMAT = "dilocox-site-seal/1"
SEAL_PREFIX = "SEAL-rank"
REPLICA_FILE_PREFIX = "replica-rank"  # + the rank, 5 digits, ".pt": each rank's replica of the global model
# Before the manifest: the round number. An empty marker is not one of those but what a crash can leave of
# a marker written without fsync: it commits nothing.
_LEGACY_COMMITTED = re.compile(r"^\s*\d+\s*$")


def seal_name(rank: int) -> str:
    return f"{SEAL_PREFIX}{rank:05d}.json"


def sha256_of(path: pathlib.Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _listed(folder: pathlib.Path) -> list[pathlib.Path]:
    """The folder's files but its markers (`COMMITTED`, the seals)."""
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.name != COMMITTED and not p.name.startswith(SEAL_PREFIX)
    )


def own_files(folder: pathlib.Path, rank: int) -> list[pathlib.Path]:
    """The files `rank` wrote into a checkpoint folder: its DCP parts (DCP names them by the writer's
    rank in the save's group: `__<rank>_<i>.distcp`), its replica file, and on rank 0 DCP's metadata."""
    mine = re.compile(rf"^__{rank}_\d+\.distcp$")
    names = {f"{REPLICA_FILE_PREFIX}{rank:05d}.pt"} | ({".metadata"} if rank == 0 else set())
    return [p for p in _listed(folder) if mine.match(p.name) or p.name in names]


def seal(folder: pathlib.Path, round_: int, rank: int) -> dict:
    """Hash this rank's files of the checkpoint and write its seal (atomically); returns the record."""
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in own_files(folder, rank)
    }
    record = {"format": SEAL_FORMAT, "round": round_, "rank": rank, "files": files}
    write_text_atomic(folder / seal_name(rank), json.dumps(record, indent=1) + "\n", durable=True)
    return record


def commit_record(folder: pathlib.Path, round_: int, ranks: int) -> dict:
    """What rank 0 writes as `COMMITTED`: every file's size (a listing), and the seals to expect."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size} for p in _listed(folder)}
    return {"format": MANIFEST_FORMAT, "round": round_, "files": files, "seals": [seal_name(r) for r in range(ranks)]}


def verify(folder: pathlib.Path, round_: int) -> tuple[bool, str | None]:
    """(whether a manifest was checked, what is wrong or None). A legacy `COMMITTED` checks nothing."""
    try:
        text = (folder / COMMITTED).read_text()
    except (OSError, UnicodeDecodeError) as error:
        return True, f"{COMMITTED} unreadable ({error})"
    if not text.strip():
        return True, f"{COMMITTED} is empty (a crash while it was written: nothing was committed)"
    if _LEGACY_COMMITTED.match(text):
        return False, None
    try:
        record = json.loads(text)
        files, found_round = record["files"], record["round"]
        assert record["format"] in (MANIFEST_FORMAT, MANIFEST_FORMAT_1) and isinstance(files, dict)
        seals = record.get("seals", []) if record["format"] == MANIFEST_FORMAT else []
        assert isinstance(seals, list)
    except (ValueError, KeyError, TypeError, AssertionError):
        return True, f"{COMMITTED} is not a manifest this build reads"
    if found_round != round_:
        return True, f"{COMMITTED} is round {found_round}'s"
    hashes = {name: want["sha256"] for name, want in files.items() if "sha256" in want}
    unsealed = []
    for name in seals:
        try:
            sealed = json.loads((folder / name).read_text())
            assert sealed["format"] == SEAL_FORMAT and sealed["round"] == round_
            hashes.update({n: w["sha256"] for n, w in sealed["files"].items()})
        except FileNotFoundError:
            unsealed.append(name)
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            return True, f"{name} is damaged"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return True, f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return True, f"{name} holds {path.stat().st_size} bytes, not {want['bytes']}"
        if name in hashes and sha256_of(path) != hashes[name]:
            return True, f"{name} does not match its SHA-256"
    if unsealed:
        log.warning(
            "worker_checkpoint_partly_verified",
            path=str(folder),
            unsealed=unsealed,
            reason="those ranks stopped before they had hashed their part: its files are checked by size only",
        )
    return True, None
