"""Signed exports: a manifest of every exported file, signed with the exporter's key, and its check.

Why: an exported model leaves the run — to a model hub, a bucket, another team. Whoever loads it should
be able to tell that the files are the ones the run's operator exported, unchanged, with nothing added
or taken away, and where they came from (`provenance.json`, worker/export/provenance.py). This module
writes dilocox's own signature from the standard pieces (checked with no extra package): an in-toto
Statement v1 (one subject per file: its name and SHA-256) in a DSSE envelope, signed with the exporter's key — ECDSA
P-256/SHA-256 as `dilocox certs`
makes them, or Ed25519, or RSA-PSS — with the signer's public key, and its certificate chain when one is
given, beside it (docs/decisions.md, "How is an exported model signed, and checked?"). Beside it, where the
`signing` extra is installed, worker/export/openssf.py writes the OpenSSF model-signing `model.sig` that
`model_signing verify` reads.

`dilocox-signature.json`:

    {"mediaType": MEDIA_TYPE,
     "dsseEnvelope": {"payloadType": "application/vnd.in-toto+json", "payload": <base64 statement>,
                      "signatures": [{"keyid": <sha256 of the public key>, "sig": <base64>}]},
     "verificationMaterial": {"publicKey": <PEM>, "certificates": [<PEM>, ...]}}

The file must be byte for byte as this module writes it (canonical JSON, canonical base64): an edit
anywhere in it is refused, never silently ignored. Key and certificate handling is in common/signing_keys.py.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import pathlib
from dataclasses import dataclass, field

from dilocox.common.signing_keys import (
    Signer,
    SigningError,
    check_chain,
    describe_key,
    key_id,
    load_certificates,
    load_public_key,
    signs_code,
    to_pem,
    verify_signature,
)

SIGNATURE_FILE = "dilocox-signature.json"
OPENSSF_SIGNATURE = "model.sig"  # written after ours, over ours too (worker/export/openssf.py): never in our manifest
PROVENANCE_FILE = "provenance.json"
MEDIA_TYPE = "application/vnd.dilocox.signature.v1+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "urn:dilocox:export-manifest:v1"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    """One exported file as signed: its path inside the folder ('/'-separated), size and SHA-256."""

    path: str
    size: int
    sha256: str

    def as_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a signed export, named by the file it concerns."""

    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


@dataclass
class Verification:
    """What `verify_folder` found: `ok` only when the signature holds and every file is as signed."""

    signer: str  # the signer's certificate subject, or its key's fingerprint
    checked_against: str  # what the signature was checked with: a CA, a key, or the file's own key
    files: list[FileDigest] = field(default_factory=list)  # as signed (provenance.json included)
    problems: list[Problem] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)  # provenance.json, when intact
    key: object = None  # the public key the signature was checked with (--key's, or the file's own), once known

    @property
    def ok(self) -> bool:
        return not self.problems


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def listing(folder: pathlib.Path) -> tuple[list[str], list[str]]:
    """(files, symbolic links) under `folder`, relative and sorted. Links are never followed: a link in
    a signed folder could point anywhere, so it is reported, not read."""
    files, links = [], []
    for root, dirs, names in os.walk(folder):
        here = pathlib.Path(root)
        for name in sorted(names) + [d for d in dirs if (here / d).is_symlink()]:
            path = here / name
            (links if path.is_symlink() else files).append(path.relative_to(folder).as_posix())
    return sorted(files), sorted(links)


def digest_files(
    folder: str | os.PathLike, exclude: frozenset[str] = frozenset({SIGNATURE_FILE, PROVENANCE_FILE, OPENSSF_SIGNATURE})
) -> list[FileDigest]:
    """Every file under `folder` but `exclude`, with its size and SHA-256, sorted by path."""
    folder = pathlib.Path(folder)
    files, links = listing(folder)
    if links:
        raise SigningError(f"{folder} holds symbolic links ({', '.join(links)}): an export to sign holds only files")
    return [FileDigest(p, (folder / p).stat().st_size, sha256_file(folder / p)) for p in files if p not in exclude]


def _pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed, the payload bound to its type."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object, what: str) -> bytes:
    """Strict base64: only the canonical encoding is accepted, so no changed character goes unnoticed
    (a lenient decoder ignores a final character's spare bits)."""
    try:
        data = base64.b64decode(text, validate=True) if isinstance(text, str) else None
    except (binascii.Error, ValueError):
        data = None
    if data is None or _b64(data) != text:
        raise SigningError(f"{SIGNATURE_FILE} is malformed: its {what} is not base64 as dilocox writes it")
    return data


def _canonical(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def statement(files: list[FileDigest], provenance: FileDigest) -> dict:
    """The in-toto Statement signed: every exported file and the provenance record as subjects, their
    sizes and which subject is the provenance record in the predicate."""
    every = [*files, provenance]
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f.path, "digest": {"sha256": f.sha256}} for f in every],
        "predicateType": PREDICATE_TYPE,
        "predicate": {"provenance": provenance.path, "sizes": {f.path: f.size for f in every}},
    }


def sign_folder(folder: str | os.PathLike, signer: Signer, files: list[FileDigest] | None = None) -> pathlib.Path:
    """Sign the export in `folder`, whose provenance.json is written: writes dilocox-signature.json and
    returns its path. `files` are the exported files' digests when the caller has just computed them
    (for provenance.json: a model's weights are hashed once)."""
    folder = pathlib.Path(folder)
    if not (folder / PROVENANCE_FILE).is_file():
        raise SigningError(f"{folder} has no {PROVENANCE_FILE}: the provenance record is written before signing")
    files = digest_files(folder) if files is None else files
    provenance = FileDigest(
        PROVENANCE_FILE, (folder / PROVENANCE_FILE).stat().st_size, sha256_file(folder / PROVENANCE_FILE)
    )
    payload = json.dumps(statement(files, provenance), sort_keys=True, separators=(",", ":")).encode()
    public = signer.key.public_key()
    document = {
        "mediaType": MEDIA_TYPE,
        "dsseEnvelope": {
            "payloadType": PAYLOAD_TYPE,
            "payload": _b64(payload),
            "signatures": [{"keyid": key_id(public), "sig": _b64(signer.sign(_pae(PAYLOAD_TYPE, payload)))}],
        },
        "verificationMaterial": {"publicKey": to_pem(public), "certificates": [to_pem(c) for c in signer.certificates]},
    }
    path = folder / SIGNATURE_FILE
    path.write_text(_canonical(document))
    return path


@dataclass(frozen=True)
class _Envelope:
    payload: bytes
    signature: bytes
    public_key: object
    certificates: list


def _read_envelope(folder: pathlib.Path) -> _Envelope:
    """The signature file, parsed and checked for shape; `SigningError` (one line) when it is missing or
    malformed. Nothing in it is trusted yet."""
    path = folder / SIGNATURE_FILE
    if not folder.is_dir():
        raise SigningError(f"{folder} is not a folder")
    if not path.is_file():
        raise SigningError(
            f"{folder} has no {SIGNATURE_FILE}: this export was not signed (dilocox export --sign-key KEY.pem)"
        )
    try:
        text = path.read_bytes().decode("utf-8")
        document = json.loads(text)
    except (UnicodeDecodeError, ValueError) as error:
        raise SigningError(f"{SIGNATURE_FILE} is malformed: not JSON ({error})") from None
    try:
        envelope, material = document["dsseEnvelope"], document["verificationMaterial"]
        (entry,) = envelope["signatures"]
        shape_ok = document["mediaType"] == MEDIA_TYPE and envelope["payloadType"] == PAYLOAD_TYPE
        pem, cert_pems, keyid = material["publicKey"], material["certificates"], entry["keyid"]
        payload_text, signature_text = envelope["payload"], entry["sig"]
    except (KeyError, TypeError, ValueError):
        shape_ok = False
    if not shape_ok or not isinstance(pem, str) or not isinstance(cert_pems, list):
        raise SigningError(f"{SIGNATURE_FILE} is malformed: not a dilocox signature ({MEDIA_TYPE}, one DSSE signature)")
    if text != _canonical(document):
        raise SigningError(f"{SIGNATURE_FILE} is malformed: it is not byte for byte as dilocox wrote it (edited?)")
    payload, signature = _unb64(payload_text, "payload"), _unb64(signature_text, "signature")
    public_key = load_public_key(pem.encode(), f"{SIGNATURE_FILE}'s public key")
    certificates = [
        load_certificates(c.encode() if isinstance(c, str) else b"", f"{SIGNATURE_FILE}'s certificate")[0]
        for c in cert_pems
    ]
    if to_pem(public_key) != pem or [to_pem(c) for c in certificates] != cert_pems:
        raise SigningError(f"{SIGNATURE_FILE} is malformed: a key or certificate in it is not PEM as dilocox writes it")
    if keyid != key_id(public_key):
        raise SigningError(f"{SIGNATURE_FILE} is malformed: its keyid is not its public key's")
    if certificates and key_id(certificates[0].public_key()) != keyid:
        raise SigningError(f"{SIGNATURE_FILE} is malformed: its first certificate is not for its public key")
    return _Envelope(payload, signature, public_key, certificates)


def _signed_files(payload: bytes) -> tuple[list[FileDigest], str]:
    """(files as signed, the provenance record's path) from a statement whose signature has held."""
    bad = SigningError(f"{SIGNATURE_FILE} is malformed: its signed statement is not a dilocox export manifest")
    try:
        body = json.loads(payload)
        if body["_type"] != STATEMENT_TYPE or body["predicateType"] != PREDICATE_TYPE:
            raise bad
        sizes, provenance = body["predicate"]["sizes"], body["predicate"]["provenance"]
        files = [FileDigest(s["name"], sizes[s["name"]], s["digest"]["sha256"]) for s in body["subject"]]
    except (ValueError, KeyError, TypeError):
        raise bad from None
    paths = [f.path for f in files]
    for f in files:
        parts = f.path.split("/") if isinstance(f.path, str) else [""]
        if f.path.startswith("/") or "\\" in f.path or any(p in ("", ".", "..") for p in parts):
            raise SigningError(f"{SIGNATURE_FILE} is malformed: it signs a path outside the folder: {f.path!r}")
        if not isinstance(f.size, int) or not isinstance(f.sha256, str):
            raise bad
    if len(set(paths)) != len(paths) or set(sizes) != set(paths) or provenance not in paths or SIGNATURE_FILE in paths:
        raise bad
    return files, provenance


def _check_files(folder: pathlib.Path, files: list[FileDigest], provenance: str) -> list[Problem]:
    present, links = listing(folder)
    problems = [Problem(p, "a symbolic link: not the file that was signed") for p in links]
    signed = {f.path for f in files}
    for f in files:
        path = folder / f.path
        what = "provenance record" if f.path == provenance else "file"
        if f.path in links:
            continue
        if f.path not in present:
            problems.append(
                Problem(f.path, f"missing: the {what} was signed but is not in the folder (removed or renamed)")
            )
            continue
        size = path.stat().st_size
        if size != f.size:
            problems.append(Problem(f.path, f"{what} changed: {size} bytes, signed with {f.size}"))
            continue
        digest = sha256_file(path)
        if digest != f.sha256:
            problems.append(Problem(f.path, f"{what} changed: sha256 {digest[:16]}…, signed {f.sha256[:16]}…"))
    problems += [
        Problem(p, "not in the signed manifest: added after signing")
        for p in present
        if p not in signed and p not in (SIGNATURE_FILE, OPENSSF_SIGNATURE)
    ]
    return sorted(problems, key=lambda p: p.path)


def verify_folder(
    folder: str | os.PathLike, ca: str | os.PathLike | None = None, key: str | os.PathLike | None = None
) -> Verification:
    """Check a signed export: the signature over the manifest (with `key`; or with the signer's
    certificate, which must chain to `ca`; or, with neither, with the public key in the signature file —
    which shows the files are as signed, not who signed them), then every signed file's size and SHA-256,
    and that no file was added or removed. `SigningError` when the signature file is missing or malformed,
    or a key or CA file cannot be read; every other failure is a `Problem` naming its file."""
    if ca is not None and key is not None:
        raise SigningError("give --cert or --key, not both")
    folder = pathlib.Path(folder)
    envelope = _read_envelope(folder)
    signer = (
        envelope.certificates[0].subject.rfc4514_string()
        if envelope.certificates
        else describe_key(envelope.public_key)
    )
    if key is not None:
        with_key, against = load_public_key(_read(key, "--key"), f"--key {key}"), f"the key in {key}"
    elif ca is not None:
        against, with_key = f"the CA in {ca}", envelope.public_key
        if not envelope.certificates:
            return Verification(
                signer,
                against,
                problems=[
                    Problem(
                        SIGNATURE_FILE,
                        "carries no certificate to check against the CA: "
                        "signed without --sign-cert (check it with --key)",
                    )
                ],
            )
        chain_problem = check_chain(envelope.certificates, load_certificates(_read(ca, "--cert"), f"--cert {ca}"))
        if chain_problem:
            return Verification(
                signer,
                against,
                problems=[Problem(SIGNATURE_FILE, f"the signer's certificate does not chain to {ca}: {chain_problem}")],
            )
        if not signs_code(envelope.certificates[0]):  # the run's CA also issues every site's client certificate
            return Verification(
                signer,
                against,
                problems=[
                    Problem(
                        SIGNATURE_FILE,
                        f"{signer}'s certificate is not a signer's (no code-signing "
                        "usage: a TLS server's or site's certificate of the run's CA), so it does "
                        "not vouch for an export; sign with one from `dilocox certs --role signer`",
                    )
                ],
            )
    else:
        with_key, against = envelope.public_key, "the public key in the signature file"
    if not verify_signature(with_key, envelope.signature, _pae(PAYLOAD_TYPE, envelope.payload)):
        whose = f"signed by {describe_key(envelope.public_key)}, " if key is not None else ""
        return Verification(
            signer,
            against,
            problems=[
                Problem(
                    SIGNATURE_FILE,
                    f"the signature does not verify with {against} "
                    f"({whose}or the signature or its manifest was changed)",
                )
            ],
            key=with_key,
        )
    files, provenance = _signed_files(envelope.payload)
    result = Verification(signer, against, files, _check_files(folder, files, provenance), key=with_key)
    if not any(p.path == provenance for p in result.problems):
        try:
            result.provenance = json.loads((folder / provenance).read_text())
        except (OSError, ValueError):
            result.provenance = {}
    return result


def _read(path: str | os.PathLike, flag: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as error:
        raise SigningError(f"{flag} {path}: {error.strerror or error}") from None
