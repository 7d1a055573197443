"""The export's OpenSSF model signature, `model.sig`: what `model_signing verify` (OpenSSF model-signing,
https://github.com/sigstore/model-transparency) and a user's supply-chain tooling read.

Why beside `dilocox-signature.json` (worker/export/signing.py), not instead of it: ours also names the
provenance record and is checked without any extra package; `model.sig` is the standard a consumer outside
the run already verifies — `model_signing verify key FOLDER --signature FOLDER/model.sig --public_key K`
(or `verify certificate … --certificate_chain CA`). It is written last, over every file of the folder —
ours and `provenance.json` included — so either tool refuses a changed byte, a missing or an extra file.

model-signing is an optional extra (`pip install "dilocox[signing]"`): where it is missing, or the key is
not an elliptic-curve key (model-signing signs with EC keys, which `dilocox certs` makes), the export is
signed our way only and says why; `dilocox verify` checks `model.sig` where the package is there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import tempfile
from collections.abc import Iterator

import structlog

from dilocox.common.signing_keys import Signer, to_pem
from dilocox.worker.export.signing import OPENSSF_SIGNATURE

log = structlog.get_logger()
INSTALL_HINT = 'pip install "dilocox[signing]" (OpenSSF model-signing)'


def available() -> bool:
    return importlib.util.find_spec("model_signing") is not None


def why_not(signer: Signer) -> str | None:
    """Why this signer cannot write `model.sig` here (None: it can)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    if not available():
        return f"model-signing is not installed: {INSTALL_HINT}"
    if not isinstance(signer.key, ec.EllipticCurvePrivateKey):
        return "OpenSSF model-signing signs with elliptic-curve keys only (as `dilocox certs` makes them)"
    if signer.key_path is None:
        return "the signer's key has no file to give model-signing"
    return None


@contextlib.contextmanager
def _pem_files(certificates) -> Iterator[list[str]]:  # noqa: ANN001 - cryptography x509 certificates
    """Each certificate in a PEM file of its own (model-signing takes paths), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="dilocox-openssf-") as tmp:
        paths = []
        for i, cert in enumerate(certificates):
            path = pathlib.Path(tmp) / f"cert{i}.pem"
            path.write_text(to_pem(cert))
            paths.append(str(path))
        yield paths


def sign_openssf(folder: str | pathlib.Path, signer: Signer) -> pathlib.Path | None:
    """Write `folder/model.sig` over every file in `folder`: with the signer's certificate and its chain where it
    has them (`model_signing verify certificate`), else with its key (`verify key`). None, logged, where it cannot."""
    reason = why_not(signer)
    if reason is not None:
        log.warning("openssf_signature_skipped", folder=str(folder), reason=reason)
        return None
    from model_signing import signing

    folder = pathlib.Path(folder)
    out = folder / OPENSSF_SIGNATURE
    with _quiet(), _pem_files(signer.certificates) as certs:
        config = signing.Config().set_hashing_config(_ignoring(out))
        if certs:
            # model-signing refuses an empty chain: a signer the CA issued directly carries its own certificate
            config.use_certificate_signer(
                private_key=signer.key_path, signing_certificate=certs[0], certificate_chain=certs[1:] or certs[:1]
            )
        else:
            config.use_elliptic_key_signer(private_key=signer.key_path)
        config.sign(folder, out)
    return out


def verify_openssf(
    folder: str | pathlib.Path, public_key_pem: bytes | None = None, ca: str | None = None
) -> str | None:
    """Check `folder/model.sig` as `model_signing verify` does: with `ca` (the signer's certificate must chain to
    it), else with `public_key_pem`. None where it holds; else what is wrong, in model-signing's words."""
    from model_signing import verifying

    folder = pathlib.Path(folder)
    with _quiet(), tempfile.TemporaryDirectory(prefix="dilocox-openssf-") as tmp:
        config = verifying.Config().set_hashing_config(_ignoring(folder / OPENSSF_SIGNATURE))
        if ca is not None:
            config.use_certificate_verifier(certificate_chain=[ca])
        else:
            key = pathlib.Path(tmp) / "key.pem"
            key.write_bytes(public_key_pem or b"")
            config.use_elliptic_key_verifier(public_key=key)
        try:
            config.verify(folder, folder / OPENSSF_SIGNATURE)
        except Exception as error:  # noqa: BLE001 - model-signing raises ValueError and its own kinds: each is a refusal
            return f"{type(error).__name__}: {error}"[:600]
    return None


def _ignoring(signature: pathlib.Path):  # noqa: ANN202 - a model_signing.hashing.Config
    """Hash every file but the signature itself, as `model_signing sign|verify --signature` inside the folder does."""
    from model_signing import hashing

    return hashing.Config().set_ignored_paths(paths=[signature.resolve()], ignore_git_paths=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """model-signing prints progress to stdout in places; a dilocox command's output stays its own."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
