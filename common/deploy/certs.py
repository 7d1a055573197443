"""`dilocox certs`: a throw-away CA plus server and client certificates, for trying TLS/mTLS."""

from __future__ import annotations

import argparse
import pathlib

from dilocox.common.security import make_dev_certificates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=pathlib.Path, required=True, help="folder for ca.pem, server*.pem, client*.pem")
    parser.add_argument("--hosts", default="localhost,127.0.0.1", help="names/IPs the server certificate is valid for")


def run(args: argparse.Namespace) -> int:
    paths = make_dev_certificates(args.out, tuple(h.strip() for h in args.hosts.split(",") if h.strip()))
    for role, path in paths.items():
        print(f"{role}: {path}")
    print("shards:  --tls-cert server.pem --tls-key server-key.pem --tls-ca ca.pem   (mTLS)")
    print("workers: --tls-ca ca.pem --tls-cert client.pem --tls-key client-key.pem")
    return 0
