"""The project's certificate authority: every TLS certificate a kit holds, and nothing signed outside it."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


class Authority:
    """The project's CA: an EC P-256 key that signs the server certificates."""

    def __init__(self, name: str, days: int) -> None:
        self.days = days
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} fedbroker CA")])
        self.cert = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def server(self, common_name: str, names: Iterable[str]) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) of a TLS server known by `names` (DNS names and IP addresses)."""
        return self._issue(common_name, names, ExtendedKeyUsageOID.SERVER_AUTH)

    def client(self, identity: str) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) a participant presents for mutual TLS, its identity as its CN."""
        return self._issue(identity, [], ExtendedKeyUsageOID.CLIENT_AUTH)

    def _issue(self, common_name: str, names: Iterable[str], usage: x509.ObjectIdentifier) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        alt = [_general_name(n) for n in dict.fromkeys(names)]
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def cert_pem(self) -> bytes:
        """The CA certificate every participant verifies the others against (it goes in every kit)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        """The CA's own key: it stays in DIR/ca, with whoever provisions the project, and goes in no kit."""
        return _key_pem(self.key)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
