"""The keys and certificates of a signed export (worker/export/signing.py) and of signed shard checkpoints
(server/state/checkpoint_signing.py): loading them, signing and checking with them, and whether a signer's
certificate chains to a CA. Here, under common/, because both the exporter and the shards sign.

Why these algorithms: `dilocox certs` makes ECDSA P-256 keys, so a run's operator can sign with what the
run already has; Ed25519 and RSA-PSS (≥ 2048 bits) cost one branch each through cryptography's generic
API. Each EC curve signs with its matching hash (P-256/SHA-256, P-384/SHA-384, P-521/SHA-512). Keys are
PEM; an encrypted private key is refused with a message (the exporter runs unattended).

Why the chain check looks as it does: `cryptography.x509.verification` (RFC 5280 path building, the
validity dates at the time of the check) is used where the installed cryptography has its extension
policies (45 and later). Its web-PKI profile would refuse the certificates `dilocox certs` makes (no
key-usage or key-identifier extensions), so the profile asked for is only: the CA is a CA (basic
constraints), any extensions on the signer's certificate. With an older cryptography the same is checked
directly: each certificate's signature by the next one up, the top one's by a certificate in the CA file,
every certificate's dates, and that each issuer is a CA.
"""

from __future__ import annotations

import datetime
import hashlib
import warnings
from dataclasses import dataclass


class SigningError(ValueError):
    """A key, certificate or signature file that cannot be used: the message is the one line the user sees."""


def _primitives():
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    return hashes, serialization, ec, ed25519, padding, rsa


_EC_HASHES = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}


def _kind(key) -> str:  # noqa: ANN001
    """'ec', 'ed25519' or 'rsa' for a supported private or public key; `SigningError` otherwise."""
    _, _, ec, ed25519, _, rsa = _primitives()
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        if key.curve.name not in _EC_HASHES:
            raise SigningError(
                f"EC curve {key.curve.name} is not supported: use P-256 (as `dilocox certs` makes), P-384 or P-521"
            )
        return "ec"
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return "ed25519"
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        if key.key_size < 2048:
            raise SigningError(f"an RSA key of {key.key_size} bits is too short: at least 2048")
        return "rsa"
    raise SigningError(f"a {type(key).__name__.lstrip('_')} key is not supported: use ECDSA (P-256), Ed25519 or RSA")


def algorithm(key) -> str:  # noqa: ANN001
    """The signature algorithm a key makes, for people: 'ecdsa-p256-sha256', 'ed25519', 'rsa3072-pss-sha256'."""
    kind = _kind(key)
    if kind == "ec":
        return f"ecdsa-p{key.curve.key_size}-{_EC_HASHES[key.curve.name].lower()}"
    return "ed25519" if kind == "ed25519" else f"rsa{key.key_size}-pss-sha256"


def _pss():
    hashes, _, _, _, padding, _ = _primitives()
    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def sign_bytes(key, data: bytes) -> bytes:  # noqa: ANN001
    hashes, _, ec, _, _, _ = _primitives()
    kind = _kind(key)
    if kind == "ec":
        return key.sign(data, ec.ECDSA(getattr(hashes, _EC_HASHES[key.curve.name])()))
    return key.sign(data) if kind == "ed25519" else key.sign(data, _pss(), hashes.SHA256())


def verify_signature(public_key, signature: bytes, data: bytes) -> bool:  # noqa: ANN001
    """Whether `signature` over `data` was made by `public_key`'s private key."""
    from cryptography.exceptions import InvalidSignature

    hashes, _, ec, _, _, _ = _primitives()
    kind = _kind(public_key)
    try:
        if kind == "ec":
            public_key.verify(signature, data, ec.ECDSA(getattr(hashes, _EC_HASHES[public_key.curve.name])()))
        elif kind == "ed25519":
            public_key.verify(signature, data)
        else:
            public_key.verify(signature, data, _pss(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


def _spki(public_key) -> bytes:  # noqa: ANN001
    _, serialization, _, _, _, _ = _primitives()
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(public_key) -> str:  # noqa: ANN001
    """A public key's fingerprint: SHA-256 over its DER SubjectPublicKeyInfo, hex."""
    return hashlib.sha256(_spki(public_key)).hexdigest()


def describe_key(public_key) -> str:  # noqa: ANN001
    return f"{algorithm(public_key)} key sha256:{key_id(public_key)[:16]}…"


def to_pem(obj) -> str:  # noqa: ANN001
    """A public key (SubjectPublicKeyInfo) or a certificate, as PEM text."""
    from cryptography import x509

    _, serialization, _, _, _, _ = _primitives()
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM).decode("ascii")
    return obj.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")


def load_certificates(data: bytes, what: str) -> list:
    """Every certificate in PEM `data` (one or a bundle); `SigningError` naming `what` when there is none."""
    from cryptography import x509

    try:
        with warnings.catch_warnings():  # a damaged certificate's parse warnings: the error below says it once
            warnings.simplefilter("ignore")
            certificates = x509.load_pem_x509_certificates(data)
    except ValueError as error:
        raise SigningError(f"{what} is not a PEM certificate ({error})") from None
    for certificate in certificates:
        try:  # cryptography parses fields lazily: read now what a check will read, so damage shows here, in one line
            _read = (certificate.subject.rfc4514_string(), certificate.issuer.rfc4514_string())
            _read += (list(certificate.extensions), certificate.not_valid_before_utc, certificate.not_valid_after_utc)
            key = certificate.public_key()
        except Exception as error:  # noqa: BLE001 — a damaged certificate fails in many ways (ValueError, KeyError, …)
            raise SigningError(f"{what} cannot be read ({type(error).__name__}: {error})") from None
        _kind(key)
    return certificates


def load_public_key(data: bytes, what: str):
    """A PEM public key, or the public key of a PEM certificate (either identifies a signer)."""
    _, serialization, _, _, _, _ = _primitives()
    if b"-----BEGIN CERTIFICATE-----" in data:
        return load_certificates(data, what)[0].public_key()
    from cryptography.exceptions import UnsupportedAlgorithm

    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        if b"PRIVATE KEY" in data:
            raise SigningError(f"{what} is a private key: give the signer's public key, or its certificate") from None
        raise SigningError(f"{what} is neither a PEM public key nor a PEM certificate") from None
    _kind(key)
    return key


@dataclass(frozen=True)
class Signer:
    """The exporter's private key, and its certificate chain (signer first) when one was given."""

    key: object
    certificates: tuple = ()
    key_path: str | None = None  # the PEM it was read from: OpenSSF model-signing reads the key from a file itself

    def sign(self, data: bytes) -> bytes:
        return sign_bytes(self.key, data)

    def describe(self) -> str:
        who = (
            self.certificates[0].subject.rfc4514_string() if self.certificates else describe_key(self.key.public_key())
        )
        return f"{who} ({algorithm(self.key)})"


def load_signer(
    key_path: str, cert_path: str | None = None, flags: tuple[str, str] = ("--sign-key", "--sign-cert")
) -> Signer:
    """The signer from `--sign-key` (PEM, unencrypted) and `--sign-cert` (PEM: the signer's certificate,
    then any intermediates), checked before anything is signed: the certificate must be the key's.
    `flags`: the two options' names, for the messages."""
    from cryptography.exceptions import UnsupportedAlgorithm

    key_flag, cert_flag = flags
    _, serialization, _, _, _, _ = _primitives()
    try:
        data = open(key_path, "rb").read()
    except OSError as error:
        raise SigningError(f"{key_flag} {key_path}: {error.strerror or error}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise SigningError(
            f"{key_flag} {key_path} is encrypted: give an unencrypted PEM key (as `dilocox certs` writes)"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as error:
        raise SigningError(f"{key_flag} {key_path} is not a PEM private key ({str(error).splitlines()[0]})") from None
    _kind(key)
    certificates: tuple = ()
    if cert_path:
        try:
            cert_data = open(cert_path, "rb").read()
        except OSError as error:
            raise SigningError(f"{cert_flag} {cert_path}: {error.strerror or error}") from None
        certificates = tuple(load_certificates(cert_data, f"{cert_flag} {cert_path}"))
        if key_id(certificates[0].public_key()) != key_id(key.public_key()):
            raise SigningError(
                f"{cert_flag} {cert_path} ({certificates[0].subject.rfc4514_string()}) is not the certificate "
                f"of {key_flag} {key_path}"
            )
    return Signer(key, certificates, key_path)


def signs_code(certificate) -> bool:  # noqa: ANN001
    """Whether `certificate` is a signer's: its extended key usage names code signing (`dilocox certs --role
    signer`), not only a TLS server's or client's."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return ExtendedKeyUsageOID.CODE_SIGNING in usage


def check_chain(chain: list, cas: list, at: datetime.datetime | None = None) -> str:
    """'' when `chain` (the signer's certificate first, then intermediates) leads to one of `cas` and
    every certificate on the way is valid `at` (now by default); otherwise what is wrong, in one line."""
    at = at or datetime.datetime.now(datetime.UTC)
    try:
        from cryptography import x509
        from cryptography.x509.verification import Criticality, ExtensionPolicy, PolicyBuilder, Store, VerificationError
    except ImportError:  # cryptography before 45
        return _check_chain_directly(chain, cas, at)
    ca_policy = ExtensionPolicy.permit_all().require_present(x509.BasicConstraints, Criticality.AGNOSTIC, None)
    builder = (
        PolicyBuilder()
        .store(Store(cas))
        .time(at)
        .extension_policies(ca_policy=ca_policy, ee_policy=ExtensionPolicy.permit_all())
    )
    try:
        builder.build_client_verifier().verify(chain[0], chain[1:])
    except VerificationError as error:
        return str(error).split(" (encountered processing")[0]
    return ""


def _check_chain_directly(chain: list, cas: list, at: datetime.datetime) -> str:
    """The chain check without cryptography's path builder: signatures up the chain to a CA in `cas`,
    every certificate's dates, and that every issuer is a CA."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    def problem_with(certificate) -> str:  # noqa: ANN001
        if not certificate.not_valid_before_utc <= at <= certificate.not_valid_after_utc:
            return (
                f"{certificate.subject.rfc4514_string()} is not valid now (valid "
                f"{certificate.not_valid_before_utc:%Y-%m-%d} to "
                f"{certificate.not_valid_after_utc:%Y-%m-%d})"
            )
        return ""

    def issued(child, parent) -> bool:  # noqa: ANN001
        try:
            constraints = parent.extensions.get_extension_for_class(x509.BasicConstraints).value
            child.verify_directly_issued_by(parent)
        except (x509.ExtensionNotFound, ValueError, TypeError, InvalidSignature):
            return False
        return constraints.ca

    for child, parent in zip(chain, chain[1:]):
        if problem_with(child) or not issued(child, parent):
            return problem_with(child) or f"{child.subject.rfc4514_string()} is not signed by the certificate after it"
    top = chain[-1]
    if problem_with(top):
        return problem_with(top)
    if any(key_id(top.public_key()) == key_id(ca.public_key()) and top.subject == ca.subject for ca in cas):
        return problem_with(next(ca for ca in cas if ca.subject == top.subject))
    anchor = next((ca for ca in cas if issued(top, ca)), None)
    if anchor is None:
        return f"{top.subject.rfc4514_string()} is not signed by a CA in the file"
    return problem_with(anchor)
