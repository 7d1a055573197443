"""Signed shard checkpoints: `dilocox server --checkpoint-sign-key` signs each checkpoint's
digest with its identity; `--resume --checkpoint-verify-key | --checkpoint-ca` refuses, by name, a file whose
signature is missing or does not hold — a changed byte with a recomputed digest included — and falls back to
an older kept version that verifies, as for a damaged one."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import pytest
import structlog
import torch

from dilocox.common.cli import main
from dilocox.common.signing_keys import load_signer
from dilocox.common.wire import checkpoint_integrity
from dilocox.common.wire.assignment import model_digest
from dilocox.common.wire.checkpoint_format import CheckpointCorrupt, load_state
from dilocox.common.wire.framing import EncodedSlice
from dilocox.server.shard import Shard
from dilocox.server.state import checkpoint, resume
from dilocox.server.state.checkpoint_signing import CheckpointForged, CheckpointTrust, signing
from tests.pki import two_authorities

RUN = "signed-ckpt-run"
PARAMS = [("w", (8, 6)), ("b", (6,))]
EXPECT = {"run_id": RUN, "shard_index": 0, "num_shards": 1}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, pathlib.Path]:
    return two_authorities(tmp_path_factory.mktemp("pki"), "shard", "shard-0")


def _shard_with_versions(directory: pathlib.Path, sign, versions: int = 3) -> Shard:
    """A shard checkpointed (signed by `sign`) at every version 0..versions-1, keeping them all."""
    shard = Shard(0, 1, RUN)
    shard.on_publish = checkpoint.Checkpointer(shard, directory, every=1, keep=versions, sign=sign)
    shard.join(RUN, "a", model_digest(PARAMS), PARAMS, "{}")
    for round_ in range(versions):
        full = {n: torch.randn(s, generator=torch.Generator().manual_seed(round_)) for n, s in PARAMS}
        shard.commit_push(
            "a", round_, 1.0, [EncodedSlice.exact(k, s.view(full[s.name]).clone()) for k, s in shard.owned.items()]
        )
    return shard


def _forge(path: pathlib.Path) -> None:
    """Change a weight and recompute the digest: what the digest alone cannot catch."""
    state = torch.load(path, weights_only=False)
    tensors = state["snapshot"]["tensors"]
    next(iter(tensors.values())).view(-1)[0] += 1.0
    torch.save(checkpoint_integrity.seal(state), path)  # the signature field is kept, as a forger would


def test_a_signed_checkpoint_verifies_with_the_key_and_the_ca_and_a_forged_one_is_refused(tmp_path, pki):
    signer = load_signer(str(pki["run-key"]), str(pki["run-cert"]))
    _shard_with_versions(tmp_path, signing(signer), versions=1)
    path = checkpoint.checkpoint_path(tmp_path, 0)
    state = load_state(path)
    for trust in (CheckpointTrust.load(str(pki["run-cert"]), None), CheckpointTrust.load(None, str(pki["run-ca"]))):
        trust.check(path, state)  # no exception
    with pytest.raises(CheckpointForged, match="does not verify with the key in .* \\(signed by another key\\)"):
        CheckpointTrust.load(str(pki["other-cert"]), None).check(path, state)
    with pytest.raises(CheckpointForged, match="does not chain to the CA in"):
        CheckpointTrust.load(None, str(pki["other-ca"])).check(path, state)

    _forge(path)
    forged = load_state(path)  # the digest holds: it was recomputed
    with pytest.raises(CheckpointForged, match=f"{path}: its signature is over other content"):
        CheckpointTrust.load(str(pki["run-cert"]), None).check(path, forged)
    forged["checkpoint_signature"]["statement"] = forged["checkpoint_signature"]["statement"].replace(
        state["integrity"], forged["integrity"]
    )
    with pytest.raises(CheckpointForged, match="its signature does not verify with the key in"):
        CheckpointTrust.load(str(pki["run-cert"]), None).check(path, forged)

    unsigned = tmp_path / "unsigned"
    _shard_with_versions(unsigned, None, versions=1)
    with pytest.raises(CheckpointForged, match="not signed \\(written without --checkpoint-sign-key\\)"):
        CheckpointTrust.load(str(pki["run-cert"]), None).check(
            unsigned / "shard-0.pt", load_state(unsigned / "shard-0.pt")
        )


def test_resume_falls_back_past_a_forged_checkpoint_to_a_signed_one(tmp_path, pki):
    signer = load_signer(str(pki["run-key"]))
    original = _shard_with_versions(tmp_path, signing(signer))
    _forge(checkpoint.checkpoint_path(tmp_path, 0))  # version 2 changed; versions 0 and 1 kept, signed
    trust = CheckpointTrust.load(str(pki["run-cert"]), None)
    assert load_state(checkpoint.checkpoint_path(tmp_path, 0))  # the digest alone would resume it
    path, state = resume.load_for_resume(tmp_path, 0, EXPECT, trust.check)
    assert state["snapshot"]["version"] == 1 and path == checkpoint.checkpoint_path(tmp_path, 0)
    assert len(list(tmp_path.glob("shard-0.pt.refused-*"))) == 1  # moved aside, named in checkpoint_fallback
    restored = Shard(0, 1, RUN)
    checkpoint.restore(restored, state)
    assert restored.chain.entries == original.chain.entries[:2]  # the rounds chain as it was at version 1

    for file in tmp_path.glob("shard-0.*pt"):
        _forge(file)
    with pytest.raises(CheckpointCorrupt, match="no intact checkpoint of shard 0.*its signature is over other content"):
        resume.load_for_resume(tmp_path, 0, EXPECT, trust.check)


@pytest.fixture
def logging_kept():
    """`dilocox server` run in-process configures the process's logging: put it back for the tests after."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_the_server_command_refuses_by_name(tmp_path, pki, logging_kept):
    common = ["server", "--run-id", RUN, "--checkpoint-dir", str(tmp_path), "--insecure", "--port", "0"]
    with pytest.raises(
        SystemExit, match="--checkpoint-verify-key / --checkpoint-ca check the checkpoint --resume restores"
    ):
        main([*common, "--checkpoint-verify-key", str(pki["run-cert"])])
    with pytest.raises(SystemExit, match="--checkpoint-sign-key .* is not a PEM private key"):
        main([*common, "--checkpoint-sign-key", str(pki["run-cert"])])
    _shard_with_versions(tmp_path, signing(load_signer(str(pki["run-key"]))), versions=1)
    _forge(checkpoint.checkpoint_path(tmp_path, 0))
    with pytest.raises(SystemExit, match="shard-0.pt: its signature is over other content"):
        main([*common, "--resume", "--checkpoint-verify-key", str(pki["run-cert"])])


def _serve(tmp_path: pathlib.Path, *flags: str) -> int:
    """`dilocox server` until it listens, then SIGTERM (which saves a checkpoint); its exit code."""
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "dilocox.common.cli",
        "server",
        "--run-id",
        RUN,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--insecure",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    return proc.returncode


def test_a_server_signs_its_checkpoints_and_resumes_only_signed_ones(tmp_path, pki):
    _serve(tmp_path, "--checkpoint-sign-key", str(pki["run-key"]), "--checkpoint-sign-cert", str(pki["run-cert"]))
    path = checkpoint.checkpoint_path(tmp_path / "ckpt", 0)
    CheckpointTrust.load(None, str(pki["run-ca"])).check(path, load_state(path))  # signed, with its certificate
    _serve(
        tmp_path,
        "--resume",
        "--checkpoint-ca",
        str(pki["run-ca"]),
        "--checkpoint-sign-key",
        str(pki["run-key"]),
        "--checkpoint-sign-cert",
        str(pki["run-cert"]),
    )
