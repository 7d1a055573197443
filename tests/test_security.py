"""TLS / mTLS through gRPC credentials, and the run token checked by a server interceptor."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from dilocox.common.deploy.certs import make_dev_certificates
from dilocox.common.security import TlsFiles
from dilocox.server.serving.grpc_server import start_server
from dilocox.server.shard import Shard
from dilocox.worker.exchange.aggregator_client import AggregatorClient, AggregatorError

RUN = "secure-run"
PARAMS = [("w", (4, 4))]
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def mtls_shard(certs):
    shard = Shard(0, 1, RUN)
    server, port = start_server(
        shard, "127.0.0.1", 0, tls=TlsFiles(certs["server"], certs["server-key"], certs["ca"]), token=TOKEN
    )
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def join(address: str, tls: TlsFiles | None, token: str | None) -> None:
    with AggregatorClient([address], RUN, "c", tls=tls, token=token, connect_timeout=3, shard_wait_s=0) as client:
        client.join(PARAMS)


def test_mtls_with_the_right_certificates_and_token_works(mtls_shard, certs):
    join(mtls_shard, TlsFiles(certs["client"], certs["client-key"], certs["ca"]), TOKEN)


def test_tls_files_given_as_strings_work_too(mtls_shard, certs):
    """docs/api.md says "PEM paths"; strings crashed with AttributeError inside the first
    connection. Now any path-like is taken, and anything else is refused where TlsFiles is made."""
    join(mtls_shard, TlsFiles(str(certs["client"]), str(certs["client-key"]), str(certs["ca"])), TOKEN)
    with pytest.raises(TypeError, match="TlsFiles.ca: a path"):
        TlsFiles(ca=42)


def test_client_without_certificate_is_refused(mtls_shard, certs):
    with pytest.raises(AggregatorError) as refused:
        join(mtls_shard, TlsFiles(None, None, certs["ca"]), TOKEN)
    assert refused.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_client_trusting_another_ca_is_refused(mtls_shard, tmp_path):
    other = make_dev_certificates(tmp_path / "other")  # a different CA: the shard's certificate fails
    with pytest.raises(AggregatorError) as refused:
        join(mtls_shard, TlsFiles(other["client"], other["client-key"], other["ca"]), TOKEN)
    assert refused.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.parametrize("token", ["wrong-token", None])
def test_wrong_or_missing_token_is_unauthenticated(mtls_shard, certs, token):
    with pytest.raises(AggregatorError) as refused:
        join(mtls_shard, TlsFiles(certs["client"], certs["client-key"], certs["ca"]), token)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "token" in refused.value.details


def test_plaintext_needs_an_explicit_insecure_flag():
    for role, extra in (("server", ["--port", "0"]), ("worker", ["--servers", "127.0.0.1:1"])):
        proc = subprocess.run(
            [sys.executable, "-m", "dilocox.common.cli", role, *extra], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode != 0
        assert "no transport security configured" in proc.stderr and "--insecure" in proc.stderr


def test_sim_runs_end_to_end_with_tls(tmp_path):
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "sim",
        "--tls",
        "--rounds",
        "2",
        "--inner-steps",
        "5",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--inner-batch-size",
        "8",
        "--log-dir",
        str(tmp_path / "logs"),
        "--summary-json",
        str(summary),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads(summary.read_text())
    assert result["ok"] and result["rounds"] == 2
    shard_log = (tmp_path / "logs" / "shard-0.log").read_text()
    assert '"tls": "mtls"' in shard_log and '"token": true' in shard_log


def _cert(path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_keeps_the_ca_key_and_issues_one_more_host_from_it(tmp_path):
    """`dilocox certs` keeps ca-key.pem (0600, with a warning naming it); `--ca` issues a certificate for
    a new host from that CA, valid `--days`; a shard serving it is reachable by that name with the old ca.pem."""
    cli = [sys.executable, "-m", "dilocox.common.cli", "certs"]
    made = subprocess.run(
        [*cli, "--out", str(tmp_path / "run"), "--hosts", "127.0.0.1", "--days", "90"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    ca_key = tmp_path / "run" / "ca-key.pem"
    assert ca_key.is_file() and ca_key.stat().st_mode & 0o777 == 0o600
    assert f"WARNING: {ca_key} is the CA's private key" in made.stderr
    server = _cert(tmp_path / "run" / "server.pem")
    assert 89 <= (server.not_valid_after_utc - server.not_valid_before_utc).days <= 91
    added = subprocess.run(
        [*cli, "--out", str(tmp_path / "new"), "--ca", str(tmp_path / "run"), "--hosts", "localhost"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    new_cert = tmp_path / "new" / "server-localhost.pem"
    assert _cert(new_cert).issuer == _cert(tmp_path / "run" / "ca.pem").subject
    shard = Shard(0, 1, RUN)
    srv, port = start_server(
        shard,
        "127.0.0.1",
        0,
        tls=TlsFiles(new_cert, tmp_path / "new" / "server-localhost-key.pem", tmp_path / "run" / "ca.pem"),
    )
    try:
        run = tmp_path / "run"
        join(f"localhost:{port}", TlsFiles(run / "client.pem", run / "client-key.pem", run / "ca.pem"), None)
    finally:
        srv.stop(grace=None)
    missing = subprocess.run(
        [*cli, "--out", str(tmp_path / "x"), "--ca", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 1 and "holds no CA" in missing.stderr


def test_a_host_name_mismatch_is_reported_as_such(tmp_path):
    """A shard whose certificate does not name the host the worker dials: the first connection error
    says so (with the names the certificate holds) at once, instead of retrying as if the shard were down."""
    certs = make_dev_certificates(tmp_path, ("shard.example.org",))
    shard = Shard(0, 1, RUN)
    server, port = start_server(shard, "127.0.0.1", 0, tls=TlsFiles(certs["server"], certs["server-key"], certs["ca"]))
    try:
        with pytest.raises(AggregatorError) as refused:
            with AggregatorClient(
                [f"127.0.0.1:{port}"],
                RUN,
                "c",
                tls=TlsFiles(certs["client"], certs["client-key"], certs["ca"]),
                connect_timeout=3,
                shard_wait_s=60,
            ) as client:
                client.join(PARAMS)
        text = refused.value.details
        assert "TLS host-name mismatch" in text and "not valid for '127.0.0.1'" in text and "shard.example.org" in text
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "dilocox.common.cli",
                "status",
                "--servers",
                f"127.0.0.1:{port}",
                "--tls-ca",
                str(certs["ca"]),
                "--tls-cert",
                str(certs["client"]),
                "--tls-key",
                str(certs["client-key"]),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 1 and "TLS host-name mismatch" in status.stdout + status.stderr
    finally:
        server.stop(grace=None)
