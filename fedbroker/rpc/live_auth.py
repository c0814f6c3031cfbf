"""Revocation, token rotation and certificate renewal without a restart: a gRPC service follows the files its
trust rests on while it runs.

- **The token table** (`tokens_file`) is looked at on every call (one `stat`: device, inode, size, mtime) and
  parsed again when it changed; the new table replaces the old one in a single assignment, so a call sees
  either table, never half of one. A token whose digest left the table is refused on its next call; a digest
  added (a rotated token) is accepted on its first.
- **The certificate revocation list**: `crl.pem` in the folder of the client CA (`tls.client_ca_file`), the
  file `fedbroker provision revoke` writes. It is followed the same way, trusted only when the client CA
  signed it, and every call whose client certificate it lists is refused UNAUTHENTICATED, `certificate
  revoked`, before any of its request data is read, also on a connection that was open before the revocation.
- **The server's own certificate, key and client CA** are served through gRPC's dynamic credentials: each new
  TLS handshake picks up renewed files (an established connection keeps the certificate it shook hands with).

A file that changed but cannot be used (invalid YAML, an empty table, a CRL the CA did not sign, a key that does
not match its certificate) keeps the last good one in force: the error is logged naming the file and the
problem, and counted in `fedbroker_auth_file_reloads_total{kind, outcome="refused"}`. A file that disappears is
treated the same way (a revocation list never silently empties). A bad file at start stops the service, as
before. Writers should replace files atomically (write a temporary file, rename it over the old one).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Generic, TypeVar, cast

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from fedbroker.errors import ConfigError, Rejection
from fedbroker.files import read_setting_file
from fedbroker.metrics import AUTH_FILE_RELOADS, GRPC_SERVER_AUTH_FAILURES, GrpcMetricsInterceptor
from fedbroker.rpc.auth import Identity, ServerAuth, ServerTLS, TokenLookup, TokenTable, admitting, read_pem
from fedbroker.rpc.plumbing import REASON_KEY

log = logging.getLogger(__name__)
T = TypeVar("T")
CRL_NAME = "crl.pem"   # beside the client CA: what `fedbroker provision revoke` writes
FileKey = tuple[int, int, int, int]


def file_key(path: str) -> FileKey | None:
    """What tells one version of a file from the next (atomic replace: a new inode), or None when it is gone."""
    try:
        st = os.stat(path)   # follows links: a Kubernetes Secret's `..data` swap is a change too
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Followed(Generic[T]):
    """The value `load(path)` parsed from a file, parsed again whenever the file changes.

    `absent`: the value while the file does not exist yet (a CRL before the first revocation); without it, a
    missing file is `load`'s error at start. After a change, a file `load` refuses (ConfigError), or one that
    disappeared, leaves the last good value in force and logs why. `kind` names the file in logs and metrics.
    """

    def __init__(self, path: str, load: Callable[[str], T], *, kind: str, absent: T | None = None) -> None:
        self.path = path
        self.kind = kind
        self._load = load
        self._lock = threading.Lock()
        AUTH_FILE_RELOADS.labels(kind, "refused")   # at 0 from the start, so the first refusal is an increase
        self._key = file_key(path)
        self._value: T = absent if self._key is None and absent is not None else load(path)

    def current(self) -> T:
        """The value of the file as it is now (one `stat` when it has not changed)."""
        key = file_key(self.path)
        if key != self._key:
            with self._lock:
                if key != self._key:   # not already reloaded by another call
                    self._reload(key)
        return self._value

    def _reload(self, key: FileKey | None) -> None:
        """Under the lock. The key is set last, so a call that comes meanwhile waits for the new value instead
        of taking the old one; a refused version is not parsed again on every call, only after its next change."""
        if key is None:
            log.error("%s %s is gone: the last one loaded stays in force (write a new one to change it)",
                      self.kind, self.path)
            AUTH_FILE_RELOADS.labels(self.kind, "refused").inc()
        else:
            try:
                self._value = self._load(self.path)
                log.info("%s %s reloaded", self.kind, self.path)
                AUTH_FILE_RELOADS.labels(self.kind, "loaded").inc()
            except ConfigError as exc:
                log.error("%s %s changed but cannot be used, the last good one stays in force: %s", self.kind,
                          self.path, exc)
                AUTH_FILE_RELOADS.labels(self.kind, "refused").inc()
        self._key = key


class LiveTokenTable:
    """A token table that follows its file (`TokenLookup` for `ServerAuth`): revocation and rotation of tokens
    take effect on the next call."""

    def __init__(self, path: str) -> None:
        self._followed = Followed(path, TokenTable.from_file, kind="tokens")

    def identify(self, token: str) -> Identity | None:
        """The token's identity in the table as the file is now, or None."""
        return self._followed.current().identify(token)

    def __len__(self) -> int:
        return len(self._followed.current())

    def __repr__(self) -> str:
        return f"LiveTokenTable({self._followed.path!r})"


def follow_table(path: str, *, service: str) -> LiveTokenTable | None:
    """A service's token table, followed while it runs, or None (authentication off), logged either way."""
    if not path:
        log.warning("%s: no token table configured: authentication is OFF (set tokens_file)", service)
        return None
    table = LiveTokenTable(path)
    log.info("%s: authentication on, %d token(s) in %s (re-read when it changes)", service, len(table), path)
    return table


# ----- certificate revocation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Revoked:
    """The serials a CA revoked (with when), from one CRL whose signature that CA's key verified."""

    issuer: bytes                       # the CA's subject, DER: serials are unique per issuer only
    serials: Mapping[int, datetime.datetime]
    next_update: datetime.datetime | None = None

    def revoked_at(self, issuer: bytes, serial: int) -> datetime.datetime | None:
        """When the certificate (`issuer`, `serial`) was revoked, or None when it is not."""
        return self.serials.get(serial) if issuer == self.issuer else None


NOTHING_REVOKED = Revoked(b"", {})


def load_crl(path: str, cas: Iterable[x509.Certificate]) -> Revoked:
    """A CRL file (PEM or DER) checked against `cas` (the client CA bundle): one of them must have issued it
    and its key must verify the signature, or it is refused (a forged list could un-revoke nothing, but could
    refuse every participant)."""
    data = read_setting_file(path, field=CRL_NAME)
    try:
        crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data)
    except ValueError as exc:
        raise ConfigError(CRL_NAME, f"{path} is not an X.509 CRL (PEM or DER): {exc}") from None
    issuers = [ca for ca in cas if ca.subject == crl.issuer]
    if not issuers:
        raise ConfigError(CRL_NAME, f"{path} was issued by {crl.issuer.rfc4514_string()!r}, which is not the "
                                    f"client CA")
    if not any(_signed_by(crl, ca) for ca in issuers):
        raise ConfigError(CRL_NAME, f"{path}: the signature does not verify with the client CA's key")
    next_update = crl.next_update_utc
    if next_update is not None and next_update < datetime.datetime.now(datetime.UTC):
        log.warning("%s: its next update was due %s; its revocations are still enforced, but issue a new one",
                    path, next_update.isoformat())
    return Revoked(crl.issuer.public_bytes(), {r.serial_number: r.revocation_date_utc for r in crl}, next_update)


def _signed_by(crl: x509.CertificateRevocationList, ca: x509.Certificate) -> bool:
    try:
        return crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]  # a CA key, never X25519
    except (InvalidSignature, TypeError, ValueError):
        return False


def load_cas(pem: bytes, *, where: str) -> list[x509.Certificate]:
    """The certificates of a client CA bundle."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ConfigError(where, f"holds no readable certificate: {exc}") from None


@lru_cache(maxsize=256)
def _serial_of(pem: bytes) -> tuple[bytes, int] | None:
    """(issuer DER, serial) of a peer certificate, parsed once per certificate, not once per call."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    return cert.issuer.public_bytes(), cert.serial_number


class RevocationCheck(grpc.ServerInterceptor):
    """Refuses every call (health checks aside) whose client certificate is on the followed CRL, as it starts:
    before its request is read, and before the token check (a revoked participant is told why)."""

    def __init__(self, crl: Followed[Revoked], *, service: str, on_reject: Callable[[str, str], None] | None = None
                 ) -> None:
        self.crl = crl
        self.service = service
        self.on_reject = on_reject

    def refusal(self, auth_context: Mapping[str, Iterable[bytes] | bytes]) -> str | None:
        """Why a caller with this auth context is refused, or None (no certificate, or one not revoked)."""
        value = auth_context.get("x509_pem_cert")
        pem = value if isinstance(value, bytes) else next(iter(value or ()), None)
        found = _serial_of(pem) if pem else None
        if found is None:
            return None
        when = self.crl.current().revoked_at(*found)
        if when is None:
            return None
        return (f"certificate revoked: the client certificate with serial {found[1]:x} was revoked by the project "
                f"CA on {when.isoformat()}")

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The method's handler, made to refuse a revoked caller as it starts (health stays open)."""
        full = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or full.startswith("/grpc.health.v1.Health/"):
            return handler
        method = full.rpartition("/")[2]

        def admit(context: grpc.ServicerContext) -> None:
            reason = self.refusal(context.auth_context())
            if reason is None:
                return
            log.warning("refused %s: %s", full, reason)
            GRPC_SERVER_AUTH_FAILURES.labels(self.service, method, Rejection.UNAUTHENTICATED).inc()
            if self.on_reject is not None:
                self.on_reject(method, Rejection.UNAUTHENTICATED)
            context.set_trailing_metadata(((REASON_KEY, Rejection.UNAUTHENTICATED),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{self.service}/{method}: {reason}")

        return admitting(handler, admit)


def crl_path(client_ca_file: str) -> str:
    """Where a port's CRL lies: `crl.pem` beside its client CA."""
    return os.path.join(os.path.dirname(os.path.abspath(client_ca_file)), CRL_NAME)


def revocation_interceptors(tls: ServerTLS | None, *, service: str,
                            on_reject: Callable[[str, str], None] | None = None) -> list[grpc.ServerInterceptor]:
    """[RevocationCheck] for a mutual-TLS port configured from files, else [] (no client certificates)."""
    if tls is None or tls.client_ca is None or not tls.client_ca_file:
        return []
    ca_file, where = tls.client_ca_file, f"{service}: tls.client_ca_file"
    load_cas(tls.client_ca, where=where)   # readable now, or the service does not start

    def load(path: str) -> Revoked:   # the CA as it is when the CRL changes (`provision renew` may renew it)
        return load_crl(path, load_cas(read_pem(ca_file, field=where) or b"", where=where))

    path = crl_path(ca_file)
    crl = Followed(path, load, kind="crl", absent=NOTHING_REVOKED)
    log.info("%s: certificate revocation list %s (%d revoked; re-read when it changes)", service, path,
             len(crl.current().serials))
    return [RevocationCheck(crl, service=service, on_reject=on_reject)]


# ----- the server's own certificate, renewed without a restart ------------------------------------------


class _CertificateFiles:
    """The fetcher of `grpc.dynamic_ssl_server_credentials`: called on every handshake, it hands gRPC a new
    configuration when the certificate, key or client CA files changed and the new key matches the new
    certificate (a renewal caught between its two renames is picked up on the next handshake)."""

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._keys = self._file_keys()

    def _file_keys(self) -> tuple[FileKey | None, ...]:
        return tuple(file_key(p) for p in (self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file) if p)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        keys = self._file_keys()
        if keys == self._keys:
            return None
        self._keys = keys   # a version refused below is looked at again only when a file changes again
        try:
            renewed = ServerTLS.from_files(self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file,
                                           where="tls")
            if renewed is None:
                raise ConfigError("tls", "the certificate files are gone")
            _check_pair(renewed.cert_chain, renewed.private_key)
        except Exception as exc:  # a handshake callback: whatever went wrong, keep serving the old files
            log.error("server certificate files changed but cannot be used, the last good ones stay in force: %s", exc)
            AUTH_FILE_RELOADS.labels("tls", "refused").inc()
            return None
        log.info("server certificate files reloaded: new connections get them")
        AUTH_FILE_RELOADS.labels("tls", "loaded").inc()
        return configuration(renewed)


def _check_pair(cert_chain: bytes, private_key: bytes) -> None:
    """ConfigError unless the key is the private half of the chain's first certificate."""
    try:
        cert = x509.load_pem_x509_certificate(cert_chain)
        key = serialization.load_pem_private_key(private_key, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError("tls.key_file", f"cannot read the certificate or key: {exc}") from None
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise ConfigError("tls.key_file", "the key does not match the certificate (a renewal half written?)")


def configuration(tls: ServerTLS) -> grpc.ServerCertificateConfiguration:
    """gRPC's certificate configuration for `tls`."""
    return grpc.ssl_server_certificate_configuration([(tls.private_key, tls.cert_chain)],
                                                     root_certificates=tls.client_ca)


def add_port(server: grpc.Server, address: str, tls: ServerTLS | None) -> int:
    """Bind `address` with TLS when configured (its files followed, when it was read from files), else
    plaintext; returns the bound port (for address port 0)."""
    if tls is None:
        return server.add_insecure_port(address)
    if not tls.cert_file:   # built from bytes (tests): nothing to follow
        return server.add_secure_port(address, tls.credentials())
    # gRPC takes None from the fetcher as "no change"; its stubs do not say so
    fetch = cast("Callable[[], grpc.ServerCertificateConfiguration]", _CertificateFiles(tls))
    credentials = grpc.dynamic_ssl_server_credentials(configuration(tls), fetch,
                                                      require_client_authentication=tls.client_ca is not None)
    return server.add_secure_port(address, credentials)


def front_interceptors(tls: ServerTLS | None, tokens: TokenLookup | None, *, service: str,
                       permissions: Mapping[str, frozenset[str]],
                       on_reject: Callable[[str, str], None]) -> tuple[list[grpc.ServerInterceptor], ServerAuth | None]:
    """What every fedbroker server checks first: its gRPC metrics, a mutual-TLS port's revocation list, and,
    with a token table (None: authentication off), the caller's token; that `ServerAuth` is returned too, as
    its identities decide what a caller may see."""
    interceptors: list[grpc.ServerInterceptor] = [
        GrpcMetricsInterceptor(), *revocation_interceptors(tls, service=service, on_reject=on_reject)]
    auth = None
    if tokens is not None:
        auth = ServerAuth(tokens, permissions, service=service, on_reject=on_reject)
        interceptors.append(auth)
    return interceptors, auth
