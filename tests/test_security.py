"""TLS / mTLS through gRPC credentials, and the run token checked by a server interceptor."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from dilocox.common.security import TlsFiles, make_dev_certificates
from dilocox.server.grpc_server import start_server
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
    server, port = start_server(shard, "127.0.0.1", 0, tls=TlsFiles(certs["server"], certs["server-key"], certs["ca"]), token=TOKEN)
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def join(address: str, tls: TlsFiles | None, token: str | None) -> None:
    with AggregatorClient([address], RUN, "c", tls=tls, token=token, connect_timeout=3, retry_s=0) as client:
        client.join(PARAMS)


def test_mtls_with_the_right_certificates_and_token_works(mtls_shard, certs):
    join(mtls_shard, TlsFiles(certs["client"], certs["client-key"], certs["ca"]), TOKEN)


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
        proc = subprocess.run([sys.executable, "-m", "dilocox.common.cli", role, *extra], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert "no transport security configured" in proc.stderr and "--insecure" in proc.stderr


def test_sim_runs_end_to_end_with_tls(tmp_path):
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "dilocox.common.cli", "sim", "--tls", "--rounds", "2", "--inner-steps", "5", "--n-layer", "1",
        "--n-embd", "32", "--inner-batch-size", "8", "--log-dir", str(tmp_path / "logs"), "--summary-json", str(summary),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads(summary.read_text())
    assert result["ok"] and result["rounds"] == 2
    shard_log = (tmp_path / "logs" / "shard-0.log").read_text()
    assert '"tls": "mtls"' in shard_log and '"token": true' in shard_log
