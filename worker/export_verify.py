"""`dilocox verify DIR`: check a signed export before loading it (worker/export_signing.py does the work).

Exit 0 when the signature holds and every file is as signed; 1 otherwise, with one line per problem
naming its file, or one line saying why nothing could be checked (no signature, a malformed signature
file, an unreadable key) — never a traceback: the person running it is deciding whether to trust a model.
"""

from __future__ import annotations

import argparse
import sys

from dilocox.worker.export_keys import SigningError
from dilocox.worker.export_signing import verify_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", metavar="DIR", help="the folder `dilocox export --sign-key` wrote")
    trust = parser.add_mutually_exclusive_group()
    trust.add_argument("--cert", metavar="CA_PEM", help="the CA the signer's certificate must chain to (e.g. the ca.pem of "
                       "`dilocox certs`); the export must have been signed with --sign-cert")  # fmt: skip
    trust.add_argument("--key", metavar="PUBLIC_PEM", help="the signer's public key (or its certificate) the signature must verify with")


def run(args: argparse.Namespace) -> int:
    try:
        result = verify_folder(args.folder, ca=args.cert, key=args.key)
    except SigningError as error:
        print(f"dilocox verify: {error}", file=sys.stderr)
        return 1
    for problem in result.problems:
        print(f"FAILED {problem}", file=sys.stderr)
    if not result.ok:
        print(f"dilocox verify: {args.folder} does not match its signature ({len(result.problems)} problem(s))", file=sys.stderr)
        return 1
    if args.cert is None and args.key is None:
        print("WARNING: no --cert or --key: the files are as signed, but by whom is not checked (anyone can re-sign a "
              "changed export with a key of their own)", file=sys.stderr)  # fmt: skip
    record = result.provenance
    print(f"ok: {len(result.files)} files as signed by {result.signer}, checked against {result.checked_against}")
    if record.get("run_id") is not None:
        source = ", ".join(f"{kind} {', '.join(where)}" for kind, where in record.get("source", {}).items()) or "unknown"
        print(f"run {record.get('run_id')} version {record.get('version')} of {record.get('final_version')}, exported "
              f"{record.get('exported_at')} by dilocox {record.get('dilocox_version')} from {source}")  # fmt: skip
    return 0
