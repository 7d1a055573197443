"""`dilocox verify DIR`: check a signed export before loading it (worker/export/signing.py does the work).

Exit 0 when the signature holds, every file is as signed and the shards' rounds chains in provenance.json
recompute (worker/export/chain.py); 1 otherwise, with one line per problem naming its file (a chain's by
shard and version), or one line saying why nothing could be checked (no signature, a malformed signature
file, an unreadable key) — never a traceback: the person running it is deciding whether to trust a model.
`--unsigned` checks an export written without a key: its files against the digests provenance.json lists,
and the chains — which shows damage and a chain edited alone, not who exported it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from dilocox.common.signing_keys import SigningError, to_pem
from dilocox.worker.export.chain import check_section
from dilocox.worker.export.signing import (
    OPENSSF_SIGNATURE,
    PROVENANCE_FILE,
    SIGNATURE_FILE,
    Problem,
    Verification,
    listing,
    sha256_file,
    verify_folder,
)

WEIGHTS_FILE = "model.safetensors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="DIR", help="the folder `dilocox export --sign-key` wrote")
    trust = parser.add_mutually_exclusive_group()
    trust.add_argument(
        "--cert",
        metavar="CA_PEM",
        help="the CA the signer's certificate must chain to (e.g. the ca.pem of "
        "`dilocox certs`); the export must have been signed with --sign-cert",
    )
    trust.add_argument(
        "--key",
        metavar="PUBLIC_PEM",
        help="the signer's public key (or its certificate) the signature must verify with",
    )
    trust.add_argument(
        "--unsigned",
        action="store_true",
        help="an export written without --sign-key: check its files against "
        "provenance.json's digests and the shards' rounds chains (damage, not who exported it)",
    )


def _provenance(folder: pathlib.Path) -> dict | None:
    try:
        record = json.loads((folder / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def check_unsigned(folder: pathlib.Path, record: dict) -> list[Problem]:
    """Every file provenance.json lists, by size and SHA-256, and none added or removed (no signature)."""
    listed = {f.get("path"): f for f in record.get("files", []) if isinstance(f, dict)}
    present, links = listing(folder)
    problems = [Problem(p, "a symbolic link: not an exported file") for p in links]
    for path, f in sorted(listed.items()):
        file = folder / str(path)
        if str(path) not in present:
            problems.append(Problem(str(path), "missing: listed in provenance.json but not in the folder"))
        elif file.stat().st_size != f.get("size") or sha256_file(file) != f.get("sha256"):
            problems.append(Problem(str(path), "file changed: not the size and SHA-256 provenance.json lists"))
    problems += [
        Problem(p, "not listed in provenance.json: added after the export")
        for p in present
        if p not in listed and p not in (PROVENANCE_FILE, SIGNATURE_FILE, OPENSSF_SIGNATURE)
    ]
    return problems


def _openssf_problems(folder: pathlib.Path, args: argparse.Namespace, result: Verification) -> list[Problem]:
    """`model.sig` (worker/export/openssf.py), checked as `model_signing verify` would — with --cert as its CA,
    else with the key our signature was just checked with (--key's, or the file's own) — where model-signing
    is installed; else a note."""
    from dilocox.worker.export import openssf as export_openssf

    if not (folder / OPENSSF_SIGNATURE).is_file():
        return []
    if not export_openssf.available():
        print(
            f"note: {OPENSSF_SIGNATURE} (OpenSSF model-signing) not checked here: {export_openssf.INSTALL_HINT}",
            file=sys.stderr,
        )
        return []
    if args.cert is not None:
        wrong = export_openssf.verify_openssf(folder, ca=args.cert)
    elif result.key is None:
        return [Problem(OPENSSF_SIGNATURE, "no public key to check it with")]
    else:
        wrong = export_openssf.verify_openssf(folder, public_key_pem=to_pem(result.key).encode())
    return [Problem(OPENSSF_SIGNATURE, f"does not verify (OpenSSF model-signing): {wrong}")] if wrong else []


def run(args: argparse.Namespace) -> int:
    folder = pathlib.Path(args.folder)
    if args.unsigned:
        record = _provenance(folder)
        if record is None:
            print(f"dilocox verify: {folder}: no readable {PROVENANCE_FILE}: not a dilocox export", file=sys.stderr)
            return 1
        problems, who = check_unsigned(folder, record), None
    else:
        try:
            result = verify_folder(folder, ca=args.cert, key=args.key)
        except SigningError as error:
            print(f"dilocox verify: {error}", file=sys.stderr)
            return 1
        problems, who = list(result.problems), result
        problems += _openssf_problems(folder, args, result)
        # The chain is checked even where provenance.json changed: its lines say which record.
        record = result.provenance or (_provenance(folder) if result.files else None) or {}
    chain = (
        check_section(record, folder / WEIGHTS_FILE if (folder / WEIGHTS_FILE).is_file() else None) if record else None
    )
    problems += [Problem(PROVENANCE_FILE, line) for line in (chain.problems if chain else [])]
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    for note in chain.notes if chain else []:
        print(f"note: {note}", file=sys.stderr)
    if problems:
        what = "its provenance record" if args.unsigned else "its signature"
        print(f"dilocox verify: {args.folder} does not match {what} ({len(problems)} problem(s))", file=sys.stderr)
        return 1
    if who is None:
        print(
            f"WARNING: --unsigned: the files are as {PROVENANCE_FILE} lists them, but nothing shows who exported them "
            "(anyone can rewrite an unsigned export whole)",
            file=sys.stderr,
        )
        print(f"ok: {len(record.get('files', []))} files as {PROVENANCE_FILE} lists them (unsigned)")
    else:
        if args.cert is None and args.key is None:
            print(
                "WARNING: no --cert or --key: the files are as signed, but by whom is not checked (anyone can re-sign "
                "a "
                "changed export with a key of their own)",
                file=sys.stderr,
            )
        print(f"ok: {len(who.files)} files as signed by {who.signer}, checked against {who.checked_against}")
    if record.get("run_id") is not None:
        source = (
            ", ".join(f"{kind} {', '.join(where)}" for kind, where in record.get("source", {}).items()) or "unknown"
        )
        print(
            f"run {record.get('run_id')} version {record.get('version')} of {record.get('final_version')}, exported "
            f"{record.get('exported_at')} by dilocox {record.get('dilocox_version')} from {source}"
        )
    if chain and chain.summary:
        print(chain.summary)
    return 0
