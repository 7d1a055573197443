"""`dilocox certs`: a certificate authority for a run, and server/client certificates signed by it.

A run's CA signs the shards' server certificates (with every name the sites connect by) and the sites'
client certificate (mTLS). The CA's key is kept, 0600, beside `ca.pem` in the output folder, so that a
host added later (a new shard host, a new name) gets a certificate from the same CA without re-issuing
anything: `dilocox certs --out DIR --ca DIR --hosts NEW`. Keep that key off the shards and sites: it can
sign a certificate for any name. Certificates are valid for `--days` (default 365).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import pathlib
import sys

DEFAULT_DAYS = 365
CA_DAYS = 3650


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: pathlib.Path) -> None:  # noqa: ANN001
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(out: pathlib.Path, days: int = CA_DAYS):
    """A new CA: writes ca.pem and ca-key.pem (0600); returns (certificate, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("dilocox run CA"))
        .issuer_name(_name("dilocox run CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, out / "ca-key.pem")
    return cert, key


def load_ca(folder: pathlib.Path):
    """(certificate, key) of an existing CA folder (ca.pem + ca-key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert_file, key_file = folder / "ca.pem", folder / "ca-key.pem"
    if not cert_file.is_file() or not key_file.is_file():
        raise FileNotFoundError(
            f"{folder} holds no CA: need ca.pem and ca-key.pem (made by `dilocox certs --out {folder}`)"
        )
    return x509.load_pem_x509_certificate(cert_file.read_bytes()), serialization.load_pem_private_key(
        key_file.read_bytes(), None
    )


def issue(
    ca, out: pathlib.Path, stem: str, role: str, hosts: tuple[str, ...], days: int = DEFAULT_DAYS
) -> dict[str, pathlib.Path]:  # noqa: ANN001
    """A `role` ("server", "client" or "signer": code signing, for exports) certificate for `hosts`, signed by
    `ca` = (cert, key): <stem>.pem + <stem>-key.pem."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert, ca_key = ca
    usage = {
        "server": ExtendedKeyUsageOID.SERVER_AUTH,
        "client": ExtendedKeyUsageOID.CLIENT_AUTH,
        "signer": ExtendedKeyUsageOID.CODE_SIGNING,
    }[role]  # signer: exports (`dilocox export --sign-cert`)
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"dilocox {role} {hosts[0] if hosts else ''}".strip()))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    paths = {stem: out / f"{stem}.pem", f"{stem}-key": out / f"{stem}-key.pem"}
    paths[stem].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, paths[f"{stem}-key"])
    return paths


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def make_dev_certificates(
    out_dir: str | pathlib.Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), days: int = DEFAULT_DAYS
) -> dict[str, pathlib.Path]:
    """A new CA (ca.pem, ca-key.pem) with server.pem/server-key.pem for `hosts`, client.pem/client-key.pem,
    and signer.pem/signer-key.pem for signing exports (code signing: what `dilocox verify --cert` accepts)."""
    out = pathlib.Path(out_dir)
    ca = make_ca(out)
    paths = {"ca": out / "ca.pem", "ca-key": out / "ca-key.pem"}
    paths |= issue(ca, out, "server", "server", hosts, days)
    paths |= issue(ca, out, "client", "client", hosts, days)
    paths |= issue(ca, out, "signer", "signer", ("exporter",), days)
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        required=True,
        help="folder for the certificates (and a new CA's ca.pem, ca-key.pem)",
    )
    parser.add_argument("--hosts", help="names/IPs the server certificate is valid for (default localhost,127.0.0.1)")
    parser.add_argument(
        "--topology",
        type=pathlib.Path,
        help="a run's topology file (`dilocox deploy topology`): every name its sites dial a shard by, plus --hosts",
    )
    parser.add_argument(
        "--ca", type=pathlib.Path, help="an existing CA folder (ca.pem + ca-key.pem): issue from it instead of a new CA"
    )
    parser.add_argument(
        "--role",
        choices=("server", "client", "signer"),
        default="server",
        help="with --ca: what to issue (default server; signer: a code-signing certificate for `dilocox export "
        "--sign-cert`, the only kind `dilocox verify --cert` accepts)",
    )
    parser.add_argument("--name", help="with --ca: file stem of the new certificate (default <role>-<first host>)")
    parser.add_argument(
        "--days", type=int, default=DEFAULT_DAYS, help=f"validity of the certificates in days (default {DEFAULT_DAYS})"
    )


def run(args: argparse.Namespace) -> int:
    hosts = tuple(
        h.strip() for h in (args.hosts or ("" if args.topology else "localhost,127.0.0.1")).split(",") if h.strip()
    )
    if args.topology:
        from dilocox.common.deploy.topology_file import TopologyFileError, load
        from dilocox.common.deploy.topology_render import certificate_hosts

        try:
            hosts = tuple(dict.fromkeys([*certificate_hosts(load(args.topology)), *hosts]))
        except TopologyFileError as error:
            print(f"dilocox certs: {error}", file=sys.stderr)
            return 1
    if args.days < 1:
        print("dilocox certs: --days must be at least 1", file=sys.stderr)
        return 1
    try:
        if args.ca:
            stem = args.name or f"{args.role}-{hosts[0]}"
            paths = issue(load_ca(args.ca), args.out, stem, args.role, hosts, args.days)
        else:
            paths = make_dev_certificates(args.out, hosts, args.days)
    except (FileNotFoundError, ValueError) as error:
        print(f"dilocox certs: {error}", file=sys.stderr)
        return 1
    for role, path in paths.items():
        print(f"{role}: {path}")
    print(
        f"valid for {args.days} days, until {(_now() + datetime.timedelta(days=args.days)).date()}; names: "
        f"{', '.join(hosts)}"
    )
    if not args.ca:
        print(
            f"WARNING: {paths['ca-key']} is the CA's private key (0600). Keep it off the shards and sites — it signs a "
            f"certificate for any name — and keep it to issue more: dilocox certs --out DIR --ca {args.out} --hosts "
            "NEW-HOST",
            file=sys.stderr,
        )
        print("shards:  --tls-cert server.pem --tls-key server-key.pem --tls-ca ca.pem   (mTLS)")
        print("workers: --tls-ca ca.pem --tls-cert client.pem --tls-key client-key.pem")
        print("export:  --sign-key signer-key.pem --sign-cert signer.pem   (dilocox verify --cert ca.pem)")
    return 0
