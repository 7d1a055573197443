"""Standard signatures: an export signed by `dilocox export --sign-key` also carries an OpenSSF
model-signing `model.sig` that `model_signing verify` accepts — with the key, or the certificate and the run's
CA — and refuses with a changed byte, a missing or an extra file, as `dilocox verify` does."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("model_signing", reason="OpenSSF model-signing: the signing extra")

from dilocox.common.cli import main  # noqa: E402
from dilocox.worker.export.signing import SIGNATURE_FILE  # noqa: E402
from tests.test_export_signing import _export, _flip, _signer  # noqa: E402

CLI = [sys.executable, "-c", "from model_signing._cli import main; main()"]


def _verify_argv(folder: pathlib.Path, mode: str, trust: pathlib.Path) -> list[str]:
    flag = "--public_key" if mode == "key" else "--certificate_chain"
    return ["verify", mode, str(folder), "--signature", str(folder / "model.sig"), flag, str(trust)]


def _verify(folder: pathlib.Path, mode: str, trust: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *_verify_argv(folder, mode, trust)], capture_output=True, text=True, timeout=120)


def _verify_here(capsys, folder: pathlib.Path, mode: str, trust: pathlib.Path) -> tuple[int, str, str]:
    """`model_signing verify` run in this process (tests/cli_refusal.py): its click command as the real CLI
    runs it, raising its `sys.exit(1)` instead of click turning it into an exit (standalone_mode=False)."""
    from model_signing._cli import main as model_signing

    from tests.cli_refusal import in_process

    return in_process(capsys, lambda: model_signing(_verify_argv(folder, mode, trust), standalone_mode=False))


@pytest.mark.parametrize("with_cert", [False, True])
def test_model_signing_and_dilocox_verify_accept_the_export_and_refuse_the_same_tampering(
    tmp_path, pki, capsys, with_cert
):
    folder = _export(tmp_path / "model", _signer(pki, with_cert=with_cert))
    assert (folder / "model.sig").is_file() and (folder / SIGNATURE_FILE).is_file()
    mode, trust = ("certificate", pki["run-ca"]) if with_cert else ("key", pki["run-cert"])
    if mode == "key":  # model-signing takes a public key: the certificate's, as PEM
        from dilocox.common.signing_keys import load_public_key, to_pem

        trust = tmp_path / "signer-pub.pem"
        trust.write_text(to_pem(load_public_key(pki["run-cert"].read_bytes(), "cert")))
    ours = [
        "verify",
        str(folder),
        "--cert" if with_cert else "--key",
        str(pki["run-ca"] if with_cert else pki["run-cert"]),
    ]
    done = _verify(folder, mode, trust)
    assert done.returncode == 0 and "Verification succeeded" in done.stdout + done.stderr, done
    assert main(ours) == 0
    capsys.readouterr()
    for name, tamper in (
        ("changed", lambda f: _flip(f / "model.safetensors")),
        ("missing", lambda f: (f / "tokenizer.json").unlink()),
        ("extra", lambda f: (f / "extra" / "added.bin").write_bytes(b"x")),
        ("provenance", lambda f: _flip(f / "provenance.json")),
    ):
        copy = tmp_path / f"model-{name}"
        shutil.copytree(folder, copy)
        tamper(copy)
        status, out, err = _verify_here(capsys, copy, mode, trust)  # the real CLI accepted the untouched one above
        assert status != 0 and "Verification succeeded" not in out, (name, status, out, err)
        assert main([ours[0], str(copy), *ours[2:]]) == 1, name
        err = capsys.readouterr().err
        assert "FAILED model.sig: does not verify (OpenSSF model-signing)" in err, (name, err)


def test_another_key_fails_both_tools(tmp_path, pki, capsys):
    folder = _export(tmp_path / "model", _signer(pki, with_cert=False))
    from dilocox.common.signing_keys import load_public_key, to_pem

    other = tmp_path / "other-pub.pem"
    other.write_text(to_pem(load_public_key(pki["other-cert"].read_bytes(), "cert")))
    assert _verify(folder, "key", other).returncode != 0
    assert main(["verify", str(folder), "--key", str(pki["other-cert"])]) == 1
