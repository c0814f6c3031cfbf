"""The project's CRL where RabbitMQ checks it: a revoked certificate refused at the broker's TLS handshake.

RabbitMQ (Erlang's `ssl`) checks client certificates against CRLs when its `ssl_options` hold `crl_check` and a
`crl_cache` of `ssl_crl_hash_dir`: a folder of CRL files named as OpenSSL's `c_rehash` names them,
`<hash of the issuer's name>.r0`. Erlang reads that folder on every handshake, so a CRL written there (whole,
renamed into place) applies to the next connection without a restart (deploy/OPERATING.md). `install_crl`
writes it under that name: the hash is OpenSSL's `X509_NAME_hash` (what `openssl crl -hash` prints and Erlang's
`public_key:short_name_hash` computes): SHA-1 over the issuer's name in canonical form (every string value
UTF-8, trimmed, inner white space collapsed to one space, ASCII lower-cased), its first four bytes read
little-endian.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from cryptography import x509

from fedbroker.errors import ConfigError
from fedbroker.files import read_setting_file

_SPACE = re.compile(r"[ \t\n\v\f\r]+")


def _length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _tlv(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + _length(len(body)) + body


def _base128(value: int) -> bytes:
    out = [value & 0x7F]
    value >>= 7
    while value:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    return bytes(reversed(out))


def _oid(dotted: str) -> bytes:
    arcs = [int(a) for a in dotted.split(".")]
    return _tlv(0x06, b"".join(_base128(v) for v in [40 * arcs[0] + arcs[1], *arcs[2:]]))


def _canonical(value: str | bytes) -> bytes:
    """An attribute's value as OpenSSL canonicalises a string: UTF8String, trimmed, collapsed, ASCII lower case."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    text = _SPACE.sub(" ", text.strip(" \t\n\v\f\r"))
    lowered = "".join(c.lower() if "A" <= c <= "Z" else c for c in text)
    return _tlv(0x0C, lowered.encode("utf-8"))


def name_hash(name: x509.Name) -> str:
    """OpenSSL's `X509_NAME_hash` of `name`, as eight hex digits (the stem of a `c_rehash` file name)."""
    encoded = b""
    for rdn in name.rdns:
        pairs = sorted(_tlv(0x30, _oid(a.oid.dotted_string) + _canonical(a.value)) for a in rdn)
        encoded += _tlv(0x31, b"".join(pairs))
    return f"{int.from_bytes(hashlib.sha1(encoded).digest()[:4], 'little'):08x}"  # SHA-1: OpenSSL's choice, not ours


def crl_file_name(issuer: x509.Name) -> str:
    """The name the broker's `ssl_crl_hash_dir` looks for the CRL of `issuer` under: `<hash>.r0`."""
    return f"{name_hash(issuer)}.r0"


def install_crl(crl_file: str, folder: str) -> Path:
    """Write the CRL in `crl_file` into `folder` as `<issuer hash>.r0` (PEM), whole: a temporary file renamed
    over the old one, so a handshake reads the old list or the new one. Returns the path written."""
    data = read_setting_file(crl_file, field="--crl")
    try:
        crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data)
    except ValueError as exc:
        raise ConfigError("--crl", f"{crl_file} is not an X.509 CRL (PEM or DER): {exc}") from None
    if not os.path.isdir(folder):
        raise ConfigError("--crl-dir", f"{folder} is not a folder (the one the broker's crl_cache names)")
    from cryptography.hazmat.primitives.serialization import Encoding

    target = Path(folder) / crl_file_name(crl.issuer)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".crl-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(crl.public_bytes(Encoding.PEM))
        os.chmod(tmp, 0o644)   # the broker's user reads it; a CRL is public
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
