"""Transport security: TLS / mTLS through gRPC's own credentials, and a per-run token in call metadata.

The link between sites crosses the internet. A shard serves TLS (and, given a CA, requires client
certificates: mTLS); every call also carries the run's shared token, which a server interceptor checks
before any handler runs. Plaintext happens only when asked for explicitly (`--insecure`, localhost/dev).
Certificates themselves are made by `dilocox certs` (common/deploy/certs.py).
"""

from __future__ import annotations

import hmac
import os
import pathlib
from dataclasses import dataclass

import grpc

TOKEN_HEADER = "authorization"
# Standard health checks (server/serving/health.py) pass without the token: orchestrators' probes hold no secrets.
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this side's certificate and key, and the CA that signs the other side."""

    cert: pathlib.Path | None = None
    key: pathlib.Path | None = None
    ca: pathlib.Path | None = None

    def __post_init__(self) -> None:
        """Paths as `str` or any `os.PathLike` are taken too (docs/api.md says "PEM paths"): a string used to
        fail with AttributeError deep inside the first connection, after the model was built."""
        for name in ("cert", "key", "ca"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, pathlib.Path):
                if not isinstance(value, (str, os.PathLike)):
                    raise TypeError(f"TlsFiles.{name}: a path (str or os.PathLike), not {type(value).__name__}")
                object.__setattr__(self, name, pathlib.Path(value))

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        def load(path: pathlib.Path | None) -> bytes | None:
            if path is None:
                return None
            if not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
            return path.read_bytes()

        return load(self.cert), load(self.key), load(self.ca)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """TLS with the server's certificate; with a CA, clients must present a certificate it signed."""
    cert, key, ca = files.read()
    if cert is None or key is None:
        raise ValueError("a TLS server needs --tls-cert and --tls-key")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    cert, key, ca = files.read()
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


class AsyncTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `authorization: Bearer <token>` metadata is not the run's token (UNAUTHENTICATED),
    on the shards' grpc.aio server; health probes pass (they carry no secrets, and health reveals nothing)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context):  # noqa: ANN001 - gRPC handler signature
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong run token")

        self._deny = {
            "Push": grpc.stream_unary_rpc_method_handler(deny),
            "Pull": grpc.unary_stream_rpc_method_handler(deny),
        }
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001
        if handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(handler_call_details)
        return self._deny.get(handler_call_details.method.rsplit("/", 1)[-1], self._deny_unary)


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor
):
    def __init__(self, token: str) -> None:
        self._metadata = (TOKEN_HEADER, f"Bearer {token}")

    def _details(self, details):  # noqa: ANN001
        metadata = list(details.metadata or []) + [self._metadata]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata) -> None:  # noqa: ANN001
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = getattr(base, "compression", None)


def open_channel(address: str, options: list, tls: TlsFiles | None, token: str | None) -> grpc.Channel:
    """A channel to one shard: TLS when `tls` is given, plaintext otherwise; the token on every call."""
    channel = (
        grpc.secure_channel(address, channel_credentials(tls), options=options)
        if tls is not None
        else grpc.insecure_channel(address, options=options)
    )
    return grpc.intercept_channel(channel, _TokenClientInterceptor(token)) if token else channel


HOSTNAME_MISMATCH = ("Hostname Verification Check failed", "is not in peer certificate", "hostname mismatch")


def is_hostname_mismatch(details: str) -> bool:
    """gRPC reports a certificate that does not name the host as UNAVAILABLE, like a shard that is down."""
    return any(marker in (details or "") for marker in HOSTNAME_MISMATCH)


def certificate_names(address: str, timeout: float = 5.0) -> list[str]:
    """The names (DNS and IP SANs) in the certificate the server at `address` presents; [] if unknown."""
    import socket
    import ssl

    from cryptography import x509

    host, _, port = address.rpartition(":")
    try:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only to read the names it holds
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host.strip("[]")) as tls:
                der = tls.getpeercert(binary_form=True)
        sans = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [str(n) for n in sans.get_values_for_type(x509.DNSName)] + [
            str(n) for n in sans.get_values_for_type(x509.IPAddress)
        ]
    except Exception:  # noqa: BLE001 - best effort, for an error message only
        return []


def explain_hostname_mismatch(address: str) -> str:
    host = address.rpartition(":")[0].strip("[]")
    names = certificate_names(address)
    held = f"it names {', '.join(names)}" if names else "its names could not be read"
    return (
        f"TLS host-name mismatch: the certificate of the shard at {address} is not valid for {host!r} ({held}). "
        f"Connect by a name the certificate holds, or issue one for this host from the run's CA: "
        f"dilocox certs --out DIR --ca DIR --hosts {host}"
    )


def add_security_arguments(parser, role: str) -> None:  # noqa: ANN001
    """--tls-cert/--tls-key/--tls-ca, --token, --insecure for a `server` or a `worker`."""
    group = parser.add_argument_group("security (TLS/mTLS and the run token; `dilocox certs` makes dev certificates)")
    if role == "server":
        group.add_argument("--tls-cert", type=pathlib.Path, help="the shard's certificate (PEM)")
        group.add_argument("--tls-key", type=pathlib.Path, help="the shard's private key (PEM)")
        group.add_argument("--tls-ca", type=pathlib.Path, help="require client certificates signed by this CA (mTLS)")
    else:
        group.add_argument("--tls-ca", type=pathlib.Path, help="CA that signed the shards' certificates (PEM)")
        group.add_argument("--tls-cert", type=pathlib.Path, help="this cluster's client certificate, for mTLS")
        group.add_argument("--tls-key", type=pathlib.Path, help="this cluster's client key, for mTLS")
    group.add_argument("--token", default=None, help="the run's shared token (default: $DILOCOX_TOKEN; none: no check)")
    group.add_argument("--insecure", action="store_true", help="plaintext, no TLS: only for localhost and development")


def security_from_args(args, role: str) -> tuple[TlsFiles | None, str | None]:  # noqa: ANN001
    """(TLS files or None for plaintext, token or None); refuses to run in plaintext unless --insecure."""
    import os

    token = args.token if args.token is not None else os.environ.get("DILOCOX_TOKEN") or None
    wants_tls = any(getattr(args, f) for f in ("tls_cert", "tls_key", "tls_ca"))
    if args.insecure:
        if wants_tls:
            raise ValueError("--insecure and --tls-* exclude each other")
        return None, token
    if not wants_tls:
        hint = "--tls-cert and --tls-key" if role == "server" else "--tls-ca"
        raise ValueError(
            f"no transport security configured: give {hint} (see `dilocox certs`), or --insecure for plaintext"
        )
    if role == "server" and not (args.tls_cert and args.tls_key):
        raise ValueError("a TLS server needs both --tls-cert and --tls-key")
    if role == "worker" and not args.tls_ca:
        raise ValueError("a TLS client needs --tls-ca to check the shards' certificates")
    return TlsFiles(args.tls_cert, args.tls_key, args.tls_ca), token
