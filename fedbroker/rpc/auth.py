"""Who may call what over gRPC: bearer tokens checked against a token table, and TLS credentials.

A caller sends `authorization: Bearer <token>` metadata on every call. A service that has a token table
(a YAML file mounted from a Secret; never from code) maps each token to an identity and a role, and a
server interceptor refuses, before any request data is read, a call with no token or an unknown one
(UNAUTHENTICATED) and a call whose role may not use the method (PERMISSION_DENIED). Checks that depend on
the request (a worker uploads only under its own id) are the servicer's, through `ServerAuth.identity`.

On a mutual-TLS port the caller proves who it is twice, and both proofs must name the same identity: the
client certificate's (`certificate_identity`) and the token's; a mismatch is PERMISSION_DENIED naming both,
so one site's certificate with another's token, or a scientist's certificate with a site's token, is refused.
A port without a client CA asks for no certificate, and the token alone names the caller.

The table keeps SHA-256 digests, so a leaked table does not leak tokens, and every lookup compares the
presented token's digest with every entry in constant time. Without a table, authentication is off (the
single-machine demo, unit tests): a service then says so once in its log. A service started from its config
follows its table's file while it runs (`fedbroker.rpc.live_auth`: revocation and rotation need no restart).

Token table format (one entry per identity; a worker's identity is its worker id):

    coordinator:
      role: coordinator
      sha256: 5e88...            # hex SHA-256 of the token (`fedbroker token` prints both)
    hospital-a:
      role: worker
      sha256: [9f86..., 2c26...] # a list while a token is being rotated
    alice:
      role: submitter
      token: plain-token-text    # accepted too (a generated per-run table), but prefer sha256
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, Self

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from fedbroker.errors import ConfigError, Rejection
from fedbroker.files import read_setting_file
from fedbroker.metrics import GRPC_SERVER_AUTH_FAILURES
from fedbroker.rpc.plumbing import CHANNEL_OPTIONS, REASON_KEY

log = logging.getLogger(__name__)

ROLE_COORDINATOR = "coordinator"   # runs rounds: OpenRound, PutGlobalModel, CloseRound, RoundStatus, Download
ROLE_WORKER = "worker"             # a data owner: Download, UploadUpdate (its own id only), RoundStatus; its
                                   # own SiteRecord on the coordinator
ROLE_SUBMITTER = "submitter"       # a data scientist: SubmitJob and Status on the coordinator
ROLE_VIEWER = "viewer"             # read-only: Status on the coordinator
ROLES = frozenset({ROLE_COORDINATOR, ROLE_WORKER, ROLE_SUBMITTER, ROLE_VIEWER})

METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16
_IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")   # the bus's worker-id rule
_HEX64 = re.compile(r"[0-9a-f]{64}")   # both used with fullmatch: `$` passes a trailing newline
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)                   # Kubernetes probes carry no token


@dataclass(frozen=True)
class Identity:
    """Who a token belongs to: `name` is also its worker id and its client certificate's CN, `role` its rights."""

    name: str
    role: str


def hash_token(token: str) -> str:
    """A token's hex SHA-256, the form a token table keeps: a leaked table does not leak tokens."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def generate_token() -> str:
    """A new random token (256 bits, URL-safe: fits in metadata, env variables and YAML unquoted)."""
    return "fbt_" + secrets.token_urlsafe(32)


class TokenTable:
    """Token digests → identities. Built from a mapping or a YAML file; never logs a digest or a token."""

    def __init__(self, entries: Iterable[tuple[Identity, str]]) -> None:
        self._entries: list[tuple[bytes, Identity]] = []
        seen: dict[str, str] = {}
        for identity, digest in entries:
            if digest in seen:
                raise ConfigError(f"tokens.{identity.name}", f"has the same token as {seen[digest]!r}")
            seen[digest] = identity.name
            self._entries.append((bytes.fromhex(digest), identity))
        if not self._entries:
            raise ConfigError("tokens", "the token table is empty; leave the tokens file unset to turn auth off")

    @classmethod
    def from_mapping(cls, raw: Any, *, where: str = "tokens") -> TokenTable:
        """From parsed YAML; every error names the entry (`where` prefixes it: the file's name)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(where, f"must be a mapping of identity → {{role, sha256 | token}}, got {type(raw).__name__}")
        entries: list[tuple[Identity, str]] = []
        for name, entry in raw.items():
            at = f"{where}.{name}"
            if not isinstance(name, str) or not _IDENTITY.fullmatch(name):
                raise ConfigError(at, "an identity is 1-128 letters, digits, '_', '.', ':' or '-' (a worker's is its id)")
            if not isinstance(entry, Mapping) or set(entry) - {"role", "sha256", "token"}:
                raise ConfigError(at, "must be a mapping with 'role' and one of 'sha256' or 'token'")
            role = entry.get("role")
            if role not in ROLES:
                raise ConfigError(f"{at}.role", f"must be one of {', '.join(sorted(ROLES))}, got {role!r}")
            if ("sha256" in entry) == ("token" in entry):
                raise ConfigError(at, "needs exactly one of 'sha256' (preferred) or 'token'")
            if "token" in entry:
                token = entry["token"]
                if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
                    raise ConfigError(f"{at}.token", f"must be a string of at least {MIN_TOKEN_CHARS} characters")
                digests = [hash_token(token)]
            else:
                value = entry["sha256"]
                digests = value if isinstance(value, list) else [value]
                if not digests or not all(isinstance(d, str) and _HEX64.fullmatch(d.lower()) for d in digests):
                    raise ConfigError(f"{at}.sha256", "must be a hex SHA-256 digest (64 characters) or a list of them")
                digests = [d.lower() for d in digests]
            entries.extend((Identity(name, role), d) for d in digests)
        return cls(entries)

    @classmethod
    def from_file(cls, path: str) -> TokenTable:
        """From a YAML file (a mounted Secret); an unreadable or invalid file is a ConfigError, not a crash."""
        import yaml

        text = read_setting_file(path, field="tokens_file", what="the token table")
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("tokens_file", f"{path} is not valid YAML: {exc}") from None
        return cls.from_mapping(raw, where=os.path.basename(path))

    def identify(self, token: str) -> Identity | None:
        """The token's identity, or None. Compares with every entry (no early exit) in constant time."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found: Identity | None = None
        for known, identity in self._entries:
            if hmac.compare_digest(known, digest):
                found = identity
        return found

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TokenTable({len(self._entries)} tokens)"


def read_secret(value: str, path: str, *, field: str) -> str:
    """A secret given inline (an env variable from a Secret) or as a file (a mounted Secret), not both."""
    if value and path:
        raise ConfigError(field, f"set either {field} or {field}_file, not both")
    if not path:
        return value
    secret = read_setting_file(path, field=f"{field}_file").decode("utf-8").strip()
    if not secret:
        raise ConfigError(f"{field}_file", f"{path} is empty")
    return secret


def read_pem(path: str, *, field: str) -> bytes | None:
    """A PEM file's bytes (None when unset), checked to be PEM so a wrong path fails at start, not at a handshake."""
    if not path:
        return None
    data = read_setting_file(path, field=field)
    if b"-----BEGIN" not in data:
        raise ConfigError(field, f"{path} is not a PEM file")
    return data


# ----- the server side ------------------------------------------------------------------------------


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of `authorization: Bearer <token>` metadata; "" for another scheme, None when absent."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def certificate_identity(auth_context: Mapping[str, Iterable[bytes] | bytes]) -> str | None:
    """The identity a caller's client certificate names, from the call's gRPC auth context.

    The rule: a certificate names identity X when its subject holds exactly one common name (CN), and it is X:
    the one field `fedbroker provision` writes into each participant's certificate, the participant's name,
    which is also its token's identity. Subject alternative names are not read (provisioning writes none into
    a client certificate; a SAN names a host). None when the caller presented no certificate (plaintext, or a
    TLS port without a client CA), "" when its certificate names no identity (no CN, or several).
    """
    value = auth_context.get("x509_pem_cert")
    pem = value if isinstance(value, bytes) else next(iter(value or ()), None)
    return _common_name(pem) if pem else None


@lru_cache(maxsize=256)
def _common_name(pem: bytes) -> str:
    """Parsed once per certificate, not once per call: a connection's calls all present the same one."""
    try:
        names = x509.load_pem_x509_certificate(pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except ValueError:  # accepted by the TLS library, unreadable to `cryptography`: refused as naming no one
        return ""
    value = names[0].value if len(names) == 1 else ""
    return value if isinstance(value, str) else ""


Rejected = Callable[[str, str], None]   # (method, reason) → count it
Refusal = tuple[grpc.StatusCode, str, str]   # (status, reason, message)


class TokenLookup(Protocol):
    """What `ServerAuth` asks of a token table: a `TokenTable`, or one that follows its file
    (`fedbroker.rpc.live_auth.LiveTokenTable`: revocation and rotation without a restart)."""

    def identify(self, token: str) -> Identity | None:
        """The token's identity, or None."""
        ...


class ServerAuth(grpc.ServerInterceptor):
    """Authenticates every call of one service (its token, and on mutual TLS a certificate naming the same
    identity) and checks the caller's role against `permissions`.

    `permissions` maps a method name to the roles that may call it; a method it does not list is refused
    to everyone (deny by default). `on_reject(method, reason)` counts a refusal in the service's metrics.
    """

    def __init__(self, table: TokenLookup, permissions: Mapping[str, frozenset[str]], *,
                 service: str, on_reject: Rejected | None = None) -> None:
        self.table = table
        self.permissions = dict(permissions)
        self.service = service
        self.on_reject = on_reject

    def identity(self, context: grpc.ServicerContext) -> Identity | None:
        """The authenticated caller of this call (the interceptor has already refused everyone else)."""
        token = bearer_token(context.invocation_metadata())
        return self.table.identify(token) if token else None

    def check(self, method: str, token: str | None, certificate: str | None = None) -> Refusal | None:
        """None when the call may proceed, else (status, reason, message).

        `certificate`: the identity the caller's client certificate names (`certificate_identity`; None when
        it presented none), which must be the token's: a stolen token is no use without its certificate's key.
        """
        if token is None:
            return (grpc.StatusCode.UNAUTHENTICATED, Rejection.UNAUTHENTICATED,
                    f"{self.service}/{method} needs a bearer token: send 'authorization: Bearer <token>' metadata")
        identity = self.table.identify(token) if token else None
        if identity is None:
            return (grpc.StatusCode.UNAUTHENTICATED, Rejection.UNAUTHENTICATED,
                    f"{self.service}/{method}: the bearer token is not valid for this service")
        if certificate is not None and certificate != identity.name:
            named = repr(certificate) if certificate else "no identity (its subject needs exactly one CN)"
            return (grpc.StatusCode.PERMISSION_DENIED, Rejection.PERMISSION_DENIED,
                    f"{self.service}/{method}: the client certificate names {named} but the bearer token names "
                    f"{identity.name!r}: certificate and token must name the same identity")
        allowed = self.permissions.get(method, frozenset())
        if identity.role not in allowed:
            return (grpc.StatusCode.PERMISSION_DENIED, Rejection.PERMISSION_DENIED,
                    f"{identity.name!r} (role {identity.role}) may not call {method}"
                    + (f"; it is for {', '.join(sorted(allowed))}" if allowed else ""))
        return None

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The method's handler, made to refuse a call `check` does not admit as it starts (health stays open)."""
        full = handler_call_details.method
        if full.startswith(_OPEN_SERVICES):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # UNIMPLEMENTED; an unknown method name never becomes a metric label
            return None
        method = full.rpartition("/")[2]

        def admit(context: grpc.ServicerContext) -> None:
            # the client certificate is known only to the call's context, not to the interceptor: checked as
            # the call starts, before its request stream is read or any later interceptor (CallGuard) runs
            refusal = self.check(method, bearer_token(context.invocation_metadata()),
                                 certificate_identity(context.auth_context()))
            if refusal is None:
                return
            code, reason, message = refusal
            log.warning("refused %s: %s", full, message)
            GRPC_SERVER_AUTH_FAILURES.labels(self.service, method, reason).inc()
            if self.on_reject is not None:
                self.on_reject(method, reason)
            context.set_trailing_metadata(((REASON_KEY, reason),))
            context.abort(code, message)

        return admitting(handler, admit)


def admitting(handler: grpc.RpcMethodHandler[Any, Any],
               admit: Callable[[grpc.ServicerContext], None]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind that runs `admit` (which ends a refused call) before the handler's own code."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_after(admit, handler.unary_unary), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_after(admit, handler.stream_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_after(admit, handler.unary_stream), **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(_after(admit, handler.stream_stream), **kwargs)
    raise TypeError(f"a gRPC method handler with no behaviour: {handler!r}")


def _after(admit: Callable[[grpc.ServicerContext], None], behaviour: Callable[[Any, grpc.ServicerContext], Any]
           ) -> Callable[[Any, grpc.ServicerContext], Any]:
    def admitted(request: Any, context: grpc.ServicerContext) -> Any:
        admit(context)
        return behaviour(request, context)  # a streaming response: its iterator, which grpc then reads

    return admitted


@dataclass(frozen=True)
class ServerTLS:
    """PEM material for a TLS server port; with `client_ca`, clients must present a certificate it signed."""

    cert_chain: bytes
    private_key: bytes = b""
    client_ca: bytes | None = None
    # the files they were read from (`from_files`), which `fedbroker.rpc.live_auth` follows while the service runs
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    def __repr__(self) -> str:
        return f"ServerTLS(mtls={self.client_ca is not None})"

    def credentials(self) -> grpc.ServerCredentials:
        """The port's credentials: with a client CA, a client without a certificate it signed gets no connection."""
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)

    @classmethod
    def from_files(cls, cert_file: str, key_file: str, client_ca_file: str = "", *, where: str) -> ServerTLS | None:
        """From a service's `tls` section (None: plaintext); half a key pair, or mTLS without TLS, is a ConfigError."""
        if not cert_file and not key_file:
            if client_ca_file:
                raise ConfigError(f"{where}.client_ca_file", "mTLS needs TLS: set cert_file and key_file too")
            return None
        if not (cert_file and key_file):
            raise ConfigError(f"{where}.cert_file", "TLS needs both cert_file and key_file")
        return cls(read_pem(cert_file, field=f"{where}.cert_file") or b"",
                   read_pem(key_file, field=f"{where}.key_file") or b"",
                   read_pem(client_ca_file, field=f"{where}.client_ca_file"),
                   cert_file=cert_file, key_file=key_file, client_ca_file=client_ca_file)


# ----- the client side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSecurity:
    """How this process calls a gRPC service: its bearer token, and TLS (CA, optional client certificate).

    `expected_target`, when set, is the only address the token may be sent to (or the only addresses, comma-
    separated: the aggregation replicas, `aggregator.targets`): a task received over the bus names the
    aggregation service, and a forged task must not be able to collect a worker's token.
    """

    token: str = ""
    ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str = ""
    expected_target: str = ""

    def __repr__(self) -> str:  # never print the token
        return (f"ClientSecurity(token={'set' if self.token else 'none'}, tls={self.tls}, "
                f"mtls={self.cert_chain is not None}, expected_target={self.expected_target!r})")

    @property
    def tls(self) -> bool:
        """Whether calls go over TLS: a CA to verify the server against is what turns it on."""
        return self.ca is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call sends: the bearer token, or nothing when this process has none."""
        return ((METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    def channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A channel to `target`, refusing one that would carry the token anywhere but `expected_target`."""
        if self.token and self.expected_target and target not in self.expected_target.split(","):
            raise ConfigError("aggregator_target", f"refusing to send this process's token to {target!r}: the "
                                                   f"configured service is {self.expected_target!r}")
        if not self.tls:
            if self.token and not _is_loopback(target):
                log.warning("sending a bearer token to %s over plaintext gRPC: configure client.ca_file (TLS)", target)
            return grpc.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                                   certificate_chain=self.cert_chain)
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(target, credentials, options=options)

    @classmethod
    def from_config(cls, client: Any, *, expected_target: str = "") -> ClientSecurity:
        """From a config's `client` section (fedbroker.config.ClientSection)."""
        if bool(client.cert_file) != bool(client.key_file):
            raise ConfigError("client.cert_file", "a client certificate needs both cert_file and key_file")
        if client.cert_file and not client.ca_file:
            raise ConfigError("client.ca_file", "a client certificate (mTLS) needs TLS: set client.ca_file")
        return cls(token=read_secret(client.token, client.token_file, field="client.token"),
                   ca=read_pem(client.ca_file, field="client.ca_file"),
                   cert_chain=read_pem(client.cert_file, field="client.cert_file"),
                   private_key=read_pem(client.key_file, field="client.key_file"),
                   server_name=client.server_name, expected_target=expected_target)


class SecuredClient:
    """A client of one fedbroker service over one channel `security` opened (every call sends `_md`, its token);
    closed by `close()` or at the end of a `with` block."""

    def __init__(self, target: str, security: ClientSecurity | None) -> None:
        security = security or ClientSecurity()
        self._channel = security.channel(target, CHANNEL_OPTIONS)
        self._md = security.metadata()

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_loopback(target: str) -> bool:
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
