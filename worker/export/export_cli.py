"""`dilocox export`: the run's global model, out of the aggregation service, as files a user can load.

The global model lives only on the shards, each holding some slices. Export assembles it — from the
running shards (a read-only observer: it joins no round, so training is never held up) or offline from
the shards' checkpoint files (worker/export/model.py) — checks that every slice of the run is there and
that all of them belong to one version, and writes a folder (worker/export/export_folder.py):
`model.safetensors`, `export.json`, `provenance.json`, with `--sign-key` `dilocox-signature.json` over all
of them, which `dilocox verify` checks, and for a Hugging Face model what `from_pretrained` loads.
`--eval` then reports the exported model's loss on the run's eval split, the same windows a cluster
evaluates on.

Its own module, as the other commands' `*_cli` modules: the flags and the errors a user sees, apart from
the assembling and writing that a simulation and the tests call directly.
"""

from __future__ import annotations

import argparse
import sys

from dilocox.common.security import add_security_arguments, security_from_args
from dilocox.common.signing_keys import SigningError, load_signer, signs_code
from dilocox.worker.data.token_data import add_data_arguments
from dilocox.worker.export.export_folder import evaluate_export, write_export
from dilocox.worker.export.model import ExportError, from_checkpoints, from_servers, served_run_id


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--servers", help="comma-separated host:port of every running shard (read-only: no round waits)"
    )
    source.add_argument("--checkpoints", help="comma-separated shard checkpoint files or folders (offline)")
    parser.add_argument(
        "--run-id",
        help="the run's id, for --servers (default: the run the shards serve, as their Status says; they must agree)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per shard call (default 120)")
    add_data_arguments(
        parser,
        "the run's data: the eval split for --eval (and, for a run whose shards did not record "
        "its tokenizer, where to find it; checked against the shards' record where there is one)",
    )
    parser.add_argument(
        "--tokenizer",
        dest="tokenizer_path",
        metavar="TOKENIZER_JSON",
        help="the run's tokenizer.json, checked against the one the shards recorded (needed only for "
        "runs whose shards did not record one)",
    )
    parser.add_argument("--model", help="where the run's --model (a config.json path) is on this machine, if elsewhere")
    parser.add_argument(
        "--eval", action="store_true", help="then report the exported model's loss on the run's eval split"
    )
    parser.add_argument(
        "--sign-key",
        metavar="KEY_PEM",
        help="sign the export with this private key (PEM: ECDSA as `dilocox certs` "
        "makes, Ed25519 or RSA): writes dilocox-signature.json, which `dilocox verify` checks",
    )
    parser.add_argument(
        "--sign-cert",
        metavar="CERT_PEM",
        help="with --sign-key: the key's certificate (then any intermediates), "
        "put in the signature so that `dilocox verify --cert CA.pem` can check who signed",
    )
    add_security_arguments(parser, "worker")


def run(args: argparse.Namespace) -> int:
    from dilocox.worker.data.sources import CorpusError
    from dilocox.worker.data.tokenizer import TokenizerError
    from dilocox.worker.models.spec import ModelSpecError

    try:
        if args.sign_cert and not args.sign_key:
            raise SigningError("--sign-cert needs --sign-key (the certificate's private key)")
        signer = (
            load_signer(args.sign_key, args.sign_cert) if args.sign_key else None
        )  # a bad key fails before the export
        if signer is not None and signer.certificates and not signs_code(signer.certificates[0]):
            raise SigningError(
                f"--sign-cert {args.sign_cert}: not a signer's certificate (no code-signing usage: a TLS "
                "server's or client's), which `dilocox verify --cert` refuses; issue one with `dilocox certs "
                "--out DIR --ca CA-DIR --role signer`"
            )
        if args.servers:
            tls, token = security_from_args(args, "worker")
            addresses = [a.strip() for a in args.servers.split(",") if a.strip()]
            run_id = args.run_id or served_run_id(addresses, tls, token, args.timeout)
            model = from_servers(addresses, run_id, tls, token, args.timeout)
        else:
            model = from_checkpoints([c.strip() for c in args.checkpoints.split(",") if c.strip()], report=print)
        out = write_export(model, args.out, args.data, args.text_field, args.model, args.tokenizer_path, signer)
        print(f"exported run {model.run_id} version {model.version}: {model.num_params:,} parameters to {out}")
        if signer is not None:
            check = "--cert <the CA's ca.pem>" if signer.certificates else "--key <the signer's public key>"
            print(f"signed by {signer.describe()}: check it with `dilocox verify {out} {check}`")
        if args.eval:
            print(f"eval loss {evaluate_export(out, args.data, args.text_field):.4f}")
    except (ExportError, ModelSpecError, TokenizerError, CorpusError, FileExistsError, ValueError) as error:
        print(f"dilocox export: {error}", file=sys.stderr)
        return 1
    return 0
