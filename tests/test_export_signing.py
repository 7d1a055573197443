"""Signed exports: `dilocox export --sign-key` signs a manifest of every exported file
and provenance.json; `dilocox verify` finds any changed, added or removed file by name, a changed
signature, the wrong key and a certificate from another CA — each as a line, exit 1, no traceback."""

from __future__ import annotations

import datetime
import json
import pathlib

import pytest
import torch

from dilocox.common.cli import main
from dilocox.common.signing_keys import (
    Signer,
    SigningError,
    _check_chain_directly,
    check_chain,
    load_certificates,
    load_signer,
)
from dilocox.worker.export.provenance import write_provenance
from dilocox.worker.export.signing import PROVENANCE_FILE, SIGNATURE_FILE, _signed_files, sign_folder, verify_folder

RUN = "signing-run"


def _signer(pki, name: str = "run", with_cert: bool = True) -> Signer:
    return load_signer(str(pki[f"{name}-key"]), str(pki[f"{name}-cert"]) if with_cert else None)


def _export(folder: pathlib.Path, signer: Signer) -> pathlib.Path:
    """An export's files (a nested one too), its provenance.json and its signature."""
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(
        torch.randn(300, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    )
    (folder / "export.json").write_text(json.dumps({"run_id": RUN, "version": 3}) + "\n")
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}\n')
    (folder / "extra").mkdir()
    (folder / "extra" / "generation_config.json").write_text("{}\n")
    write_provenance(folder, RUN, 3, 2, 3, "byte", {"rounds": 2}, {"servers": ["a:1", "b:2"]}, signer)
    return folder


@pytest.fixture
def signed(tmp_path, pki) -> pathlib.Path:
    return _export(tmp_path / "model", _signer(pki))


def _flip(path: pathlib.Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def _problems(folder, **trust) -> list[str]:
    return [str(p) for p in verify_folder(folder, **trust).problems]


def test_sign_then_verify_with_the_ca_the_key_and_the_files_own_key(signed, pki):
    for trust in ({"ca": pki["run-ca"]}, {"key": pki["run-cert"]}, {}):
        result = verify_folder(signed, **trust)
        assert result.ok, result.problems
    assert result.signer == "CN=dilocox signer exporter"
    assert [f.path for f in result.files] == [
        "export.json",
        "extra/generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        PROVENANCE_FILE,
    ]
    record = result.provenance
    assert (record["run_id"], record["version"], record["rounds"], record["final_version"]) == (RUN, 3, 2, 3)
    assert record["source"] == {"servers": ["a:1", "b:2"]} and record["tokenizer_digest"] == "byte"
    assert {f["path"] for f in record["files"]} == {f.path for f in result.files} - {PROVENANCE_FILE}
    assert record["dilocox_version"] and datetime.datetime.fromisoformat(record["exported_at"]).tzinfo is not None


@pytest.mark.parametrize("name", ["model.safetensors", "export.json", "tokenizer.json", "extra/generation_config.json"])
def test_one_changed_byte_in_any_exported_file_fails_by_name(signed, pki, name):
    _flip(signed / name)
    (problem,) = _problems(signed, ca=pki["run-ca"])
    assert problem.startswith(f"{name}: file changed: sha256 ") and ", signed " in problem


def test_a_changed_byte_in_the_provenance_record_fails_by_name(signed, pki):
    _flip(signed / PROVENANCE_FILE)
    (problem,) = _problems(signed, ca=pki["run-ca"])
    assert problem.startswith(f"{PROVENANCE_FILE}: provenance record changed: sha256")
    (signed / PROVENANCE_FILE).write_text((signed / PROVENANCE_FILE).read_text() + " ")  # a size change says so
    assert _problems(signed) == [
        f"{PROVENANCE_FILE}: provenance record changed: "
        f"{(signed / PROVENANCE_FILE).stat().st_size} bytes, signed with "
        f"{(signed / PROVENANCE_FILE).stat().st_size - 1}"
    ]


def test_a_changed_signature_fails(signed, pki):
    path = signed / SIGNATURE_FILE
    document = json.loads(path.read_text())
    sig = document["dsseEnvelope"]["signatures"][0]["sig"]
    at = path.read_text().index(sig) + 10
    text = path.read_text()
    path.write_text(text[:at] + ("A" if text[at] != "A" else "B") + text[at + 1 :])
    (problem,) = _problems(signed, ca=pki["run-ca"])
    assert problem.startswith(f"{SIGNATURE_FILE}: the signature does not verify")


def test_every_byte_of_the_signature_file_counts(signed, pki):
    """A one-byte change anywhere — the signature, the signed payload, the key, the certificate, the
    JSON around them — is refused (malformed) or fails; none goes unnoticed."""
    path = signed / SIGNATURE_FILE
    original = path.read_bytes()
    for offset in range(len(original)):
        _flip(path, offset)
        try:
            assert not verify_folder(signed, ca=pki["run-ca"]).ok, offset
        except SigningError:
            pass
        path.write_bytes(original)
    assert verify_folder(signed, ca=pki["run-ca"]).ok


def test_an_added_or_removed_file_fails_by_name(signed, pki):
    (signed / "extra" / "backdoor.py").write_text("import os\n")
    (signed / "tokenizer.json").unlink()
    assert _problems(signed, ca=pki["run-ca"]) == [
        "extra/backdoor.py: not in the signed manifest: added after signing",
        "tokenizer.json: missing: the file was signed but is not in the folder (removed or renamed)",
    ]
    (signed / "tokenizer.json").symlink_to(signed / "export.json")
    assert _problems(signed)[1] == "tokenizer.json: a symbolic link: not the file that was signed"


def test_the_wrong_key_or_a_certificate_from_another_ca_fails(signed, pki, tmp_path):
    (problem,) = _problems(signed, key=pki["other-cert"])
    assert problem.startswith(
        f"{SIGNATURE_FILE}: the signature does not verify with the key in {pki['other-cert']} (signed by ecdsa-p256"
    )
    (problem,) = _problems(signed, ca=pki["other-ca"])
    assert problem.startswith(f"{SIGNATURE_FILE}: the signer's certificate does not chain to {pki['other-ca']}")
    # Signed by a certificate of another CA: checked against the run's CA, it fails.
    foreign = _export(tmp_path / "foreign", _signer(pki, "other"))
    (problem,) = _problems(foreign, ca=pki["run-ca"])
    assert "does not chain to" in problem
    # Signed without a certificate: a CA has nothing to check; the key still works.
    bare = _export(tmp_path / "bare", _signer(pki, with_cert=False))
    assert "carries no certificate" in _problems(bare, ca=pki["run-ca"])[0]
    assert verify_folder(bare, key=pki["run-cert"]).ok


def test_ed25519_and_rsa_pss_keys_sign_and_verify(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    for name, make in (
        ("ed25519", ed25519.Ed25519PrivateKey.generate),
        ("rsa", lambda: rsa.generate_private_key(65537, 2048)),
    ):
        key, other = make(), make()
        folder = _export(tmp_path / name, Signer(key))
        public = tmp_path / f"{name}.pub"
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        assert verify_folder(folder, key=public).ok
        public.write_bytes(
            other.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        assert "does not verify" in _problems(folder, key=public)[0]


def test_the_direct_chain_check_agrees_with_cryptographys_path_builder(pki):
    """The fallback for a cryptography without x509.verification's extension policies."""
    run_ca, other_ca = (load_certificates(pki[f"{n}-ca"].read_bytes(), n) for n in ("run", "other"))
    signer = load_certificates(pki["run-cert"].read_bytes(), "signer")
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=400)
    for check in (check_chain, _check_chain_directly):
        now = datetime.datetime.now(datetime.UTC)
        assert check(signer, run_ca, now) == ""
        assert check(signer, other_ca, now) != ""
        assert check(signer, run_ca, later) != ""  # expired (365 days)


def test_signing_refuses_a_certificate_that_is_not_the_keys_and_unusable_keys(pki, tmp_path):
    with pytest.raises(SigningError, match="is not the certificate of --sign-key"):
        load_signer(str(pki["run-key"]), str(pki["other-cert"]))
    with pytest.raises(SigningError, match="is not a PEM private key"):
        load_signer(str(pki["run-cert"]))
    with pytest.raises(SigningError, match="No such file"):
        load_signer(str(tmp_path / "absent.pem"))
    from cryptography.hazmat.primitives import serialization

    locked = tmp_path / "locked.pem"
    key = _signer(pki).key
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(SigningError, match="is encrypted"):
        load_signer(str(locked))
    (tmp_path / "bare").mkdir()
    with pytest.raises(SigningError, match="no provenance.json"):
        sign_folder(tmp_path / "bare", _signer(pki))


def test_a_manifest_naming_a_path_outside_the_folder_is_malformed():
    statement = {
        "_type": "https://in-toto.io/Statement/v1",
        "predicateType": "urn:dilocox:export-manifest:v1",
        "subject": [{"name": "../../etc/passwd", "digest": {"sha256": "0" * 64}}],
        "predicate": {"provenance": "../../etc/passwd", "sizes": {"../../etc/passwd": 1}},
    }
    with pytest.raises(SigningError, match="outside the folder"):
        _signed_files(json.dumps(statement).encode())


def test_verify_command_messages_and_exit_codes(signed, pki, tmp_path, capsys):
    assert main(["verify", str(signed), "--cert", str(pki["run-ca"])]) == 0
    out = capsys.readouterr().out
    assert "ok: 5 files as signed by CN=dilocox signer exporter" in out and f"run {RUN} version 3 of 3" in out
    _flip(signed / "model.safetensors")
    assert main(["verify", str(signed), "--cert", str(pki["run-ca"])]) == 1
    err = capsys.readouterr().err
    from dilocox.worker.export.openssf import available

    expected = 2 if available() else 1  # model.sig (OpenSSF) fails too where model-signing wrote and checks it
    assert "FAILED model.safetensors: file changed" in err and f"{expected} problem(s)" in err
    cases = {
        "no dilocox-signature.json: this export was not signed": (tmp_path, []),
        "is not a folder": (tmp_path / "absent", []),
        "is a private key: give the signer's public key": (signed, ["--key", str(pki["run-key"])]),
        "--cert": (signed, ["--cert", str(tmp_path / "absent.pem")]),
    }
    for message, (folder, extra) in cases.items():
        assert main(["verify", str(folder), *extra]) == 1
        assert message in capsys.readouterr().err, message
    (signed / SIGNATURE_FILE).write_text("{not json")
    assert main(["verify", str(signed)]) == 1
    assert "dilocox-signature.json is malformed: not JSON" in capsys.readouterr().err


def test_export_command_signs_and_verify_checks_it(tmp_path, pki, capsys):
    """The whole path: shards' checkpoints → `dilocox export --sign-key --sign-cert` → `dilocox verify --cert`."""
    from dilocox.common.wire.assignment import model_digest
    from dilocox.common.wire.framing import EncodedSlice
    from dilocox.server.shard import Shard
    from dilocox.server.state import checkpoint

    params = [("w", (8, 6)), ("b", (6,))]
    for index in range(2):
        shard = Shard(index, 2, RUN)
        shard.join(RUN, "cluster-a", model_digest(params), params, "{}")
        for round_ in range(3):
            full = {n: torch.randn(s, generator=torch.Generator().manual_seed(round_)) for n, s in params}
            shard.commit_push(
                "cluster-a",
                round_,
                1.0,
                [EncodedSlice.exact(k, s.view(full[s.name]).clone()) for k, s in shard.owned.items()],
            )
        checkpoint.save(shard, tmp_path / "ckpt")
    export = ["export", "--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model")]
    assert main([*export, "--sign-key", str(pki["run-cert"])]) == 1  # not a key: refused before anything is written
    assert "is not a PEM private key" in capsys.readouterr().err and not (tmp_path / "model").exists()
    assert main([*export, "--sign-key", str(pki["run-key"]), "--sign-cert", str(pki["run-cert"])]) == 0
    assert f"dilocox verify {tmp_path / 'model'} --cert" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "model"), "--cert", str(pki["run-ca"])]) == 0
    record = json.loads((tmp_path / "model" / PROVENANCE_FILE).read_text())
    assert record["run_id"] == RUN and record["version"] == 2 and record["tokenizer_digest"] == "byte"
    assert record["source"] == {"checkpoints": [str(tmp_path / "ckpt" / f"shard-{i}.pt") for i in range(2)]}
    assert {f["path"] for f in record["files"]} == {"model.safetensors", "export.json"}
    assert main(["verify", str(tmp_path / "model"), "--cert", str(pki["other-ca"])]) == 1
    _flip(tmp_path / "model" / "model.safetensors")
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "model"), "--key", str(pki["run-cert"])]) == 1
    assert "FAILED model.safetensors: file changed" in capsys.readouterr().err


def _change_a_header_digit(path: pathlib.Path) -> None:
    """One digit of a tensor's data offsets in a safetensors header: the header no longer parses."""
    import struct

    data = bytearray(path.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + size].decode()
    at = header.index(",", header.index('"data_offsets":[')) + 1
    data[8 + at] = ord("9" if header[at] != "9" else "8")
    path.write_bytes(bytes(data))


def test_a_changed_digit_of_the_weights_header_fails_by_name_not_with_a_traceback(tmp_path, pki, capsys):
    """safetensors refuses such a header with an error of its own type, which the rounds
    chain's weight check did not catch: `dilocox verify` printed a traceback, signed or --unsigned."""
    from dilocox.common.wire.assignment import model_digest
    from dilocox.common.wire.framing import EncodedSlice
    from dilocox.server.shard import Shard
    from dilocox.server.state import checkpoint

    params = [("w", (8, 6)), ("b", (6,))]
    shard = Shard(0, 1, RUN)
    shard.join(RUN, "cluster-a", model_digest(params), params, "{}")
    full = {n: torch.randn(s, generator=torch.Generator().manual_seed(0)) for n, s in params}
    shard.commit_push(
        "cluster-a", 0, 1.0, [EncodedSlice.exact(k, s.view(full[s.name]).clone()) for k, s in shard.owned.items()]
    )
    checkpoint.save(shard, tmp_path / "ckpt")
    model = tmp_path / "model"
    assert (
        main(
            [
                "export",
                "--checkpoints",
                str(tmp_path / "ckpt"),
                "--out",
                str(model),
                "--sign-key",
                str(pki["run-key"]),
                "--sign-cert",
                str(pki["run-cert"]),
            ]
        )
        == 0
    )
    _change_a_header_digit(model / "model.safetensors")
    capsys.readouterr()
    for flags in (["--cert", str(pki["run-ca"])], ["--unsigned"]):
        assert main(["verify", str(model), *flags]) == 1
        err = capsys.readouterr().err
        assert "FAILED model.safetensors: file changed" in err, err
        assert (
            "FAILED provenance.json: model.safetensors: cannot be read to check it against the rounds chain" in err
        ), err


def test_a_site_certificate_of_the_run_ca_does_not_vouch_for_an_export(tmp_path, pki, capsys):
    """`verify --cert` accepted an export signed with any certificate of the run's CA — the CA that
    issues every site's client certificate. Now only a signer's (code-signing usage, `dilocox certs --role
    signer`) vouches for an export, and `export --sign-cert` refuses another before exporting anything."""
    from dilocox.common.deploy.certs import issue, load_ca
    from dilocox.common.signing_keys import load_signer

    site = issue(load_ca(pki["run-ca"].parent), tmp_path / "site", "site", "client", ("site-a",))
    folder = _export(tmp_path / "by-a-site", load_signer(str(site["site-key"]), str(site["site"])))
    problems = _problems(folder, ca=pki["run-ca"])
    assert (
        len(problems) == 1
        and "CN=dilocox client site-a's certificate is not a signer's (no code-signing usage" in problems[0]
    )
    assert not _problems(
        folder, key=site["site"]
    )  # with the site's own key given: the files are as that key signed them
    assert (
        main(
            [
                "export",
                "--checkpoints",
                str(tmp_path / "none"),
                "--out",
                str(tmp_path / "model"),
                "--sign-key",
                str(site["site-key"]),
                "--sign-cert",
                str(site["site"]),
            ]
        )
        == 1
    )
    assert (
        "not a signer's certificate (no code-signing usage" in capsys.readouterr().err
        and not (tmp_path / "model").exists()
    )
