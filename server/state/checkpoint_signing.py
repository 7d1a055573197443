"""Signed shard checkpoints: `dilocox server --checkpoint-sign-key` signs every checkpoint it writes, and
`--resume` with `--checkpoint-verify-key` or `--checkpoint-ca` restores only a checkpoint whose signature holds.

Why: a checkpoint's integrity digest (common/wire/checkpoint_integrity.py) finds damage, but it is a plain
SHA-256 over the content: whoever can write the checkpoint folder can change the weights, or a record of
the rounds chain, and recompute it. The signature is over the digest, bound to the run id, shard index,
shard count and version, made with a key the folder does not hold (the same kinds of keys and certificates
an export is signed with: common/signing_keys.py). A file whose signature is missing, is over other
content, or does not verify is refused by name like a damaged one (`CheckpointForged` is a
`CheckpointCorrupt`): `--resume` falls back to the newest older kept version that verifies, and stops with
the reasons when none does (server/state/resume.py).

The signature is the saved dict's `checkpoint_signature` field (left out of the digest, as the digest is):

    {"payload_type": PAYLOAD_TYPE, "statement": <canonical JSON: run_id, shard_index, num_shards, version,
     integrity>, "sig": <base64 over DSSE's PAE(payload_type, statement)>, "public_key": <PEM>,
     "certificates": [<PEM>, ...]}
"""

from __future__ import annotations

import base64
import binascii
import json
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

from dilocox.common.signing_keys import (
    Signer,
    SigningError,
    check_chain,
    load_certificates,
    load_public_key,
    to_pem,
    verify_signature,
)
from dilocox.common.wire.checkpoint_format import CheckpointCorrupt, snapshot_version
from dilocox.common.wire.checkpoint_integrity import FIELD, SIGNATURE_FIELD

PAYLOAD_TYPE = "application/vnd.dilocox.shard-checkpoint.v1+json"


class CheckpointForged(CheckpointCorrupt):
    """A checkpoint whose signature is missing, over other content, or not made by the trusted key."""


def _pae(payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: the statement bound to its type (what is signed)."""
    kind = PAYLOAD_TYPE.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def _statement(state: dict) -> str:
    return json.dumps(
        {
            "run_id": state.get("run_id"),
            "shard_index": state.get("shard_index"),
            "num_shards": state.get("num_shards"),
            "version": snapshot_version(state),
            "integrity": state.get(FIELD),
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def signing(signer: Signer) -> Callable[[dict], dict]:
    """What `save_state` applies to a sealed state to sign it with `signer`."""

    def sign(sealed: dict) -> dict:
        statement = _statement(sealed)
        return {
            **sealed,
            SIGNATURE_FIELD: {
                "payload_type": PAYLOAD_TYPE,
                "statement": statement,
                "sig": base64.b64encode(signer.sign(_pae(statement.encode()))).decode("ascii"),
                "public_key": to_pem(signer.key.public_key()),
                "certificates": [to_pem(c) for c in signer.certificates],
            },
        }

    return sign


@dataclass(frozen=True)
class CheckpointTrust:
    """Whose checkpoints a resuming shard accepts: those signed by `key`, or by a certificate chaining to `cas`."""

    against: str  # for the messages: "the key in PUB.pem" or "the CA in CA.pem"
    key: object | None = None
    cas: tuple = ()

    @classmethod
    def load(cls, key_path: str | None, ca_path: str | None) -> CheckpointTrust | None:
        """From `--checkpoint-verify-key` (a public key or a certificate) or `--checkpoint-ca`; `SigningError`
        (one line) for a file that cannot be used."""
        if key_path and ca_path:
            raise SigningError("give --checkpoint-verify-key or --checkpoint-ca, not both")
        if key_path:
            return cls(
                f"the key in {key_path}",
                key=load_public_key(_read(key_path, "--checkpoint-verify-key"), f"--checkpoint-verify-key {key_path}"),
            )
        if ca_path:
            return cls(
                f"the CA in {ca_path}",
                cas=tuple(load_certificates(_read(ca_path, "--checkpoint-ca"), f"--checkpoint-ca {ca_path}")),
            )
        return None

    def check(self, path: str | pathlib.Path, state: dict) -> None:
        """Refuse (`CheckpointForged`, naming the file) a loaded checkpoint — its digest already checked
        against its content — whose signature is missing, is over another digest or identity, or does not
        verify with this trust."""
        signature = state.get(SIGNATURE_FIELD)
        if signature is None:
            raise CheckpointForged(
                f"{path}: not signed (written without --checkpoint-sign-key); this shard restores only "
                f"checkpoints signed by {self.against}"
            )
        try:
            statement, sig_text = signature["statement"], signature["sig"]
            sig = base64.b64decode(sig_text, validate=True)
            certificates = [
                load_certificates(c.encode(), f"{path}'s certificate")[0] for c in signature["certificates"]
            ]
            embedded = load_public_key(signature["public_key"].encode(), f"{path}'s public key")
            well_formed = signature["payload_type"] == PAYLOAD_TYPE and isinstance(statement, str)
        except (KeyError, TypeError, AttributeError, binascii.Error, ValueError):
            well_formed = False
        if not well_formed:
            raise CheckpointForged(f"{path}: its signature is malformed")
        if statement != _statement(state):
            raise CheckpointForged(
                f"{path}: its signature is over other content or another shard's version (the checkpoint "
                "was changed and its digest recomputed, or the signature copied from another file)"
            )
        key = self.key
        if key is None:
            if not certificates:
                raise CheckpointForged(
                    f"{path}: its signature carries no certificate to check against {self.against} "
                    "(signed without --checkpoint-sign-cert)"
                )
            problem = check_chain(certificates, list(self.cas))
            if problem:
                raise CheckpointForged(f"{path}: the signer's certificate does not chain to {self.against}: {problem}")
            key = certificates[0].public_key()
        if not verify_signature(key, sig, _pae(statement.encode())):
            whose = "" if to_pem(embedded) == to_pem(key) else " (signed by another key)"
            raise CheckpointForged(f"{path}: its signature does not verify with {self.against}{whose}")


def _read(path: str, flag: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as error:
        raise SigningError(f"{flag} {path}: {error.strerror or error}") from None
