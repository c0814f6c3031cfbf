"""Why a RabbitMQ connection failed, in one line an operator can act on: where (host, port, virtual host,
user), the reason, and what to check.

pika wraps the cause of a failed connect in layers (`AMQPConnectionError(AMQPConnectorSocketConnectError(
ConnectionRefusedError))`) whose outer `str()` is empty, so the log used to say `failed (AMQPConnectionError: )`.
`describe` digs out the cause; `ProblemLog` keeps the bus's two connections from saying the same thing twice
and a broker that stays away from filling the log (one line, then a reminder every tenth attempt).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("fedbroker.bus.amqp_link")

REMIND_EVERY = 10  # attempts: a broker still away is said again this often (the rest at DEBUG)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every exception pika or Python hung under it, outermost first, each once."""
    seen: set[int] = set()
    queue: list[BaseException | None] = [exc]
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        nested: Any = getattr(e, "exceptions", None)  # pika's AMQPConnectionWorkflowFailed: every attempt's
        queue += [getattr(e, "exception", None), *(a for a in e.args if isinstance(a, BaseException)),
                  *(reversed(nested) if isinstance(nested, (list, tuple)) else ()), e.__cause__, e.__context__]


def where(url: str) -> tuple[str, int, str, str]:
    """(host, port, virtual host, user) a broker URL connects to, pika's defaults filled in."""
    import pika

    params = pika.URLParameters(url)
    user = str(getattr(params.credentials, "username", "") or "(client certificate)")
    return str(params.host), int(params.port), str(params.virtual_host), user


def reason(exc: BaseException, url: str) -> tuple[str, str]:
    """(what went wrong, what to check) for a failed or lost connection to the broker at `url`."""
    import pika.exceptions as pex

    host, _port, vhost, user = where(url)
    causes = list(_causes(exc))
    refused = _tls_alert(causes)
    if refused:
        return refused
    for e in causes:
        if isinstance(e, (pex.ProbableAuthenticationError, pex.AuthenticationError)):
            return (f"the broker refused the login of user {user!r}",
                    "the user and password in broker.url (or broker.url_file)")
        if isinstance(e, pex.ProbableAccessDeniedError):
            return (f"user {user!r} may not use virtual host {vhost!r}",
                    f"the user's permissions on that virtual host (rabbitmqctl list_permissions -p {vhost})")
        if isinstance(e, pex.ConnectionClosedByBroker):
            return (f"the broker closed the connection ({e.reply_code} {e.reply_text})",
                    "the broker's log for this connection")
        if isinstance(e, pex.ChannelClosedByBroker) and e.reply_code == 403:
            return (f"the broker refused user {user!r} an operation ({e.reply_code} {e.reply_text})",
                    f"the user's permissions (rabbitmqctl list_user_permissions {user}; a provisioned kit's are in "
                    f"the server kit's rabbitmq/definitions.json, applied by fedbroker broker sync)")
        if isinstance(e, pex.ChannelClosedByBroker):
            return (f"the broker closed a channel ({e.reply_code} {e.reply_text})", "the broker's log")
        if isinstance(e, pex.IncompatibleProtocolError):
            return _closed_in_handshake(url)
    for e in causes:
        if isinstance(e, ssl.SSLError):
            return (f"the TLS handshake failed ({getattr(e, 'verify_message', '') or e.reason or e})",
                    "broker.ca_file, that the broker's certificate names this host, and broker.cert_file/key_file")
        if isinstance(e, socket.gaierror):
            return (f"the host name {host!r} does not resolve ({e.strerror})", "the host in broker.url and DNS")
        if isinstance(e, ConnectionRefusedError):
            return ("connection refused: nothing listens there",
                    "that RabbitMQ runs and listens on that port, and that broker.url names its host and port")
        if isinstance(e, (TimeoutError, socket.timeout)) or type(e).__name__ == "AMQPConnectorStackTimeout":
            return ("no answer (timed out)", "a firewall between here and the broker, and the host and port")
        if isinstance(e, OSError) and e.strerror:
            return (e.strerror[0].lower() + e.strerror[1:], "the network between here and the broker")
    for e in causes:  # nothing known: the innermost message there is
        text = str(e).strip()
        if text:
            return f"{type(e).__name__}: {text}", "the broker's log and its network"
    return type(exc).__name__, "the broker's log and its network"


# TLS alerts the broker sends about this client's certificate (OpenSSL's names), and what they mean to a site. pika
# reports them as a lost stream, then as an incompatible protocol: only the alert's text tells what happened.
_ALERTS = {
    "ALERT_CERTIFICATE_REVOKED": ("the broker refused this client's certificate: it is revoked (the project's CRL)",
                                  "with the project's operator whether this participant was revoked; a renewed kit's "
                                  "tls/client.* in broker.cert_file/key_file"),
    "ALERT_CERTIFICATE_EXPIRED": ("the broker refused this client's certificate: it has expired",
                                  "the kit's renewed tls/client.* (fedbroker provision renew) in broker.cert_file/key_file"),
    "ALERT_CERTIFICATE_REQUIRED": ("the broker requires a client certificate and got none",
                                   "broker.cert_file and broker.key_file (the kit's tls/client.*)"),
    "ALERT_UNKNOWN_CA": ("the broker does not trust this client's certificate (unknown CA)",
                         "that broker.cert_file is this project's kit's tls/client.crt"),
    "ALERT_BAD_CERTIFICATE": ("the broker refused this client's certificate",
                              "broker.cert_file/key_file and the broker's log"),
}


def _tls_alert(causes: list[BaseException]) -> tuple[str, str] | None:
    """(reason, check) for a TLS alert the broker sent about this client's certificate, named in any cause's text."""
    text = " ".join(str(e) for e in causes).upper()
    return next((said for alert, said in _ALERTS.items() if alert in text), None)


def _closed_in_handshake(url: str) -> tuple[str, str]:
    """pika's IncompatibleProtocolError: the peer closed the connection before the AMQP handshake finished, which
    pika cannot tell from a peer that is no broker. Over TLS it is what a broker that refuses this client's
    certificate after the TLS handshake (a revoked one, TLS 1.3) looks like when its alert is not read."""
    if urlsplit(url).scheme.lower() == "amqps":
        return ("the broker closed the connection right after the TLS handshake, before the AMQP handshake, without "
                "a reason",
                "whether this participant's certificate was revoked or is not trusted (the broker's log names it; "
                "broker.cert_file/key_file are the kit's tls/client.*), and that the port is the broker's AMQPS port")
    return ("the connection was closed before the AMQP handshake finished, without a reason",
            "that the port is RabbitMQ's AMQP port (5672; a TLS listener such as 5671 needs amqps://) and the "
            "broker's log")


def describe(exc: BaseException, url: str, *, lost: bool = False) -> str:
    """`cannot reach the broker at HOST:PORT (virtual host V, user U): REASON; check WHAT` (`lost the connection
    to ...` for a connection that was up)."""
    host, port, vhost, user = where(url)
    why, check = reason(exc, url)
    verb = "lost the connection to" if lost else "cannot reach"
    return f"{verb} the broker at {host}:{port} (virtual host {vhost}, user {user}): {why}; check {check}"


class ProblemLog:
    """What the connections of one bus said about the broker: a problem is logged once as a warning (not by
    both connections), repeated at DEBUG, and said again every REMIND_EVERY attempts while it lasts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: str = ""
        self._repeats = 0

    def failed(self, role: str, exc: BaseException, url: str, *, connected_before: bool, delay: float) -> None:
        """Log one failed connect (or a lost connection) of the `role` link."""
        line = describe(exc, url, lost=connected_before)
        key = f"{connected_before}:{reason(exc, url)[0]}"  # not the address: a cluster's nodes, tried in turn, say it once
        with self._lock:
            fresh = key != self._said
            self._said, self._repeats = key, 0 if fresh else self._repeats + 1
            remind = not fresh and self._repeats % REMIND_EVERY == 0
        if fresh:
            log.warning("bus: %s; retrying in %.2fs", line, delay)
        elif remind:
            log.warning("bus: still %s (%d failed attempts); retrying", line, self._repeats + 1)
        else:
            log.debug("bus %s: %s; retrying in %.2fs", role, line, delay)

    def connected(self) -> None:
        """A connection came up: the next problem is news again."""
        with self._lock:
            self._said, self._repeats = "", 0
