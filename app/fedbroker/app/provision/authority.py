"""The project's certificate authority: every TLS certificate a kit holds, and nothing signed outside it; and
its certificate revocation list (CRL), which names the certificates it no longer vouches for."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedbroker.errors import ConfigError

SKEW = datetime.timedelta(minutes=5)   # a certificate is valid from a little before its issue (clocks differ)


@dataclass(frozen=True)
class Revoked:
    """One certificate the CA no longer vouches for: its serial, when, and why (an RFC 5280 reason name)."""

    serial: int
    when: datetime.datetime
    reason: x509.ReasonFlags


class Authority:
    """The project's CA: an EC P-256 key that signs every certificate of the project, and its CRL."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, days: int) -> None:
        self.key = key
        self.cert = cert
        self.days = days

    @classmethod
    def create(cls, name: str, days: int) -> Authority:
        """A new CA for project `name`, valid `days`."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} fedbroker CA")])
        return cls(key, _ca_certificate(key, subject, days), days)

    @classmethod
    def load(cls, folder: Path, days: int) -> Authority:
        """The CA `fedbroker provision` wrote into `folder` (ca.crt and ca.key): later kits are signed by the same one."""
        try:
            cert = x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes())
            key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
        except OSError as exc:
            raise ConfigError("--out", f"cannot read the project's CA in {folder}: {exc.strerror} ({exc.filename}); "
                                       f"the CA's folder must stay beside the kits it signed") from None
        except ValueError as exc:
            raise ConfigError("--out", f"the CA in {folder} is not a PEM certificate and key: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise ConfigError("--out", f"{folder}/ca.key is not the key of {folder}/ca.crt")
        return cls(key, cert, days)

    def renewed(self) -> Authority:
        """The same CA (same key and name: every certificate it signed still verifies) valid `days` from now."""
        return Authority(self.key, _ca_certificate(self.key, self.cert.subject, self.days), self.days)

    def server(self, common_name: str, names: Iterable[str]) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) of a TLS server known by `names` (DNS names and IP addresses)."""
        return self._issue(common_name, names, ExtendedKeyUsageOID.SERVER_AUTH)

    def client(self, identity: str) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) a participant presents for mutual TLS, its identity as its CN."""
        return self._issue(identity, [], ExtendedKeyUsageOID.CLIENT_AUTH)

    def _issue(self, common_name: str, names: Iterable[str], usage: x509.ObjectIdentifier) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        # never beyond the CA's own certificate: a chain is only as valid as its CA
        until = min(now + datetime.timedelta(days=self.days), self.cert.not_valid_after_utc)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - SKEW).not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        alt = [_general_name(n) for n in dict.fromkeys(names)]
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def crl(self, revoked: Sequence[Revoked], *, number: int, next_update_days: int) -> bytes:
        """The CRL (PEM) listing `revoked`, numbered `number` (each new one higher), due again in `next_update_days`."""
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateRevocationListBuilder().issuer_name(self.cert.subject)
            .last_update(now - SKEW).next_update(now + datetime.timedelta(days=next_update_days))
            .add_extension(x509.CRLNumber(number), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        for entry in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(entry.serial).revocation_date(entry.when)
                .add_extension(x509.CRLReason(entry.reason), critical=False).build())
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def cert_pem(self) -> bytes:
        """The CA certificate every participant verifies the others against (it goes in every kit)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        """The CA's own key: it stays in DIR/ca, with whoever provisions the project, and goes in no kit."""
        return _key_pem(self.key)


def _ca_certificate(key: ec.EllipticCurvePrivateKey, subject: x509.Name, days: int) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
