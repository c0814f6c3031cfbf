"""`fedbroker broker sync` (fedbroker.app.broker_users) applies a kit's broker users to a running RabbitMQ: on a
private node (never the machine's broker), a site removed from definitions.json is deleted, its open connection
closed and its next login refused, while the other site keeps publishing on its connection and logging in, and
a site added to the file can log in, all without restarting the node. Another project's users that share the
name prefix, and administrators, are left alone. With the broker's own CRL check set up (Erlang's crl_check and
a hashed CRL folder), the CRL that `sync --crl` installs refuses a revoked certificate's next TLS handshake."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pika
import pika.exceptions
import pytest

from fedbroker.app.broker_crl import install_crl, name_hash
from fedbroker.app.broker_users import Ctl, make_plan, project_prefix, sync
from fedbroker.app.cli import main
from fedbroker.app.provision.configs import rabbitmq_password_hash
from fedbroker.errors import BusError, ConfigError
from tests.rabbitmq_node import PrivateRabbitMQ, free_ports, missing, start_private_rabbitmq
from tests.security.pki import Authority, Pair

WAIT_S = 120.0


def definitions(passwords: dict[str, str]) -> dict[str, object]:
    """A kit's definitions.json for these users (as `fedbroker provision` writes them)."""
    return {"users": [{"name": u, "password_hash": rabbitmq_password_hash(p),
                       "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []} for u, p in passwords.items()],
            "vhosts": [{"name": "/"}],
            "permissions": [{"user": u, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}
                            for u in passwords]}


class Broker:
    def __init__(self, node: object, folder: Path) -> None:
        self.node = node
        self.folder = folder
        self.ctl = Ctl([str(node.scripts / "rabbitmqctl"), "-n", node.name], env=node.env)  # type: ignore[attr-defined]
        self.port = node.amqp_port  # type: ignore[attr-defined]

    def write(self, name: str, passwords: dict[str, str]) -> str:
        path = self.folder / name
        path.write_text(json.dumps(definitions(passwords)))
        return str(path)

    def connect(self, user: str, password: str) -> pika.BlockingConnection:
        params = pika.ConnectionParameters("127.0.0.1", self.port, "/", pika.PlainCredentials(user, password),
                                           connection_attempts=1, socket_timeout=10, blocked_connection_timeout=30)
        return pika.BlockingConnection(params)


@pytest.fixture
def broker(private_rabbitmq, tmp_path: Path) -> Iterator[Broker]:
    found = Broker(private_rabbitmq, tmp_path)
    yield found
    for user in found.ctl.users():   # the node is the session's: leave it with the users it started with
        if user.startswith(("rv", "other")):
            found.ctl("delete_user", user)


def publish(connection: pika.BlockingConnection, queue: str) -> None:
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_declare(queue, auto_delete=True)
    channel.basic_publish("", queue, b"still here", mandatory=True)
    channel.close()


def wait_closed(connection: pika.BlockingConnection) -> str:
    """The reason the broker gave for closing `connection` (waits for it: the close is the broker's)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            connection.process_data_events(time_limit=0.2)
        except pika.exceptions.ConnectionClosedByBroker as exc:
            return f"{exc.reply_code} {exc.reply_text}"
        except pika.exceptions.AMQPConnectionError as exc:
            return repr(exc)
    raise AssertionError(f"the broker did not close the connection in {WAIT_S:g} s")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_revoked_sites_connection_is_closed_and_its_login_refused_while_the_other_keeps_working(broker, capsys,
                                                                                                   monkeypatch):
    project = f"rv{secrets.token_hex(3)}"
    pw = {f"{project}-{who}": secrets.token_urlsafe(16) for who in ("coordinator", "site-a", "site-b")}
    # another project on the same broker whose name starts like ours, and its coordinator
    other = {f"{project}-x-coordinator": "pw-other-coordinator", f"{project}-x-site-z": "pw-other-site-z"}
    broker.ctl("import_definitions", "--format", "json", stdin=json.dumps(definitions(other)))
    plan = sync(broker.write("all.json", pw), broker.ctl)
    assert set(plan.new) == set(pw) and plan.delete == ()

    site_a = broker.connect(f"{project}-site-a", pw[f"{project}-site-a"])
    site_b = broker.connect(f"{project}-site-b", pw[f"{project}-site-b"])
    publish(site_a, "rvk.a")
    publish(site_b, "rvk.b")

    # revoke site-a, add site-c, through the command line as an operator runs it
    kept = {u: p for u, p in pw.items() if not u.endswith("site-a")}
    kept[f"{project}-site-c"] = secrets.token_urlsafe(16)
    path = broker.write("revoked.json", kept)
    for key, value in broker.ctl.env.items():
        monkeypatch.setenv(key, value)
    command = shlex.join(broker.ctl.command)
    assert main(["broker", "sync", path, "--rabbitmqctl", command, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would delete and disconnect {project}-site-a" in out and f"would add {project}-site-c" in out
    assert f"{project}-site-a" in broker.ctl.users()       # a dry run changes nothing
    publish(site_a, "rvk.a")
    assert main(["broker", "sync", path, "--rabbitmqctl", command]) == 0
    out = capsys.readouterr().out
    assert f"delete and disconnect {project}-site-a" in out
    assert f"leave {project}-x-site-z alone (another project's name)" in out

    reason = wait_closed(site_a)
    # CONNECTION_FORCED: RabbitMQ 3.10 says "user ... is deleted", a later close "...access was revoked"
    assert reason.startswith("320 CONNECTION_FORCED") and ("deleted" in reason or "revoked" in reason), reason
    with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
        broker.connect(f"{project}-site-a", pw[f"{project}-site-a"])
    publish(site_b, "rvk.b")                                # its open connection goes on
    assert site_b.is_open
    again = broker.connect(f"{project}-site-b", pw[f"{project}-site-b"])
    publish(again, "rvk.b2")
    again.close()
    site_c = broker.connect(f"{project}-site-c", kept[f"{project}-site-c"])
    publish(site_c, "rvk.c")
    site_c.close()
    site_b.close()
    users = broker.ctl.users()
    assert f"{project}-site-a" not in users
    assert set(other) <= set(users) and "guest" in users   # another project's users and the administrator


def test_the_plan_spares_administrators_and_other_projects_and_names_its_prefix():
    defs = {"users": [{"name": "p-coordinator"}, {"name": "p-site-b"}]}
    present = {"p-coordinator": [], "p-site-a": [], "p-site-b": [], "p-ops": ["administrator"],
               "p-x-coordinator": [], "p-x-site-a": [], "q-site-a": []}
    plan = make_plan(defs, present, project_prefix(defs))
    assert plan.delete == ("p-site-a",) and plan.spared == ("p-x-coordinator", "p-x-site-a")
    assert plan.new == () and plan.import_users == ("p-coordinator", "p-site-b")
    with pytest.raises(ConfigError, match="name it with --project"):
        project_prefix({"users": [{"name": "p-site-b"}]})
    with pytest.raises(ConfigError, match="outside project 'p'"):
        project_prefix({"users": [{"name": "p-site-b"}, {"name": "q-site"}]}, "p")


def test_a_missing_rabbitmqctl_or_a_failing_one_is_a_broker_error_naming_it():
    with pytest.raises(BusError, match="not found: pass --rabbitmqctl"):
        Ctl(["/nonexistent/rabbitmqctl"]).users()
    with pytest.raises(BusError, match=r"failed \(3\): boom"):
        Ctl(["sh", "-c", "echo boom >&2; exit 3"])("list_users")


# ----- the broker's own CRL check -------------------------------------------------------------------------


@dataclass
class TlsBroker:
    node: PrivateRabbitMQ
    port: int
    ca: Authority
    crls: Path

    def connect(self, pair: Pair) -> pika.BlockingConnection:
        context = ssl.create_default_context(cafile=str(self.ca.ca))
        context.load_cert_chain(str(pair.cert), str(pair.key))
        return pika.BlockingConnection(pika.ConnectionParameters(
            "localhost", self.port, "/", pika.PlainCredentials("guest", "guest"),
            ssl_options=pika.SSLOptions(context, "localhost"), connection_attempts=1, socket_timeout=10))


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    """A private node with an AMQPS listener that checks client certificates against the CRLs in a folder,
    set up as deploy/OPERATING.md says (the whole ssl_options in advanced.config, crl_check = peer); the
    project's CRL is there from the start, empty, as a kit's is."""
    folder = tmp_path_factory.mktemp("tls-broker")
    ca = Authority(folder / "pki")
    server = ca.issue("broker", "localhost", server=True)
    crls = folder / "crls"
    crls.mkdir()
    (folder / "crl.pem").write_bytes(ca.crl())
    install_crl(str(folder / "crl.pem"), str(crls))
    ports: list[int] = []

    def configure(node: PrivateRabbitMQ) -> None:
        ports[:] = free_ports(1)
        with open(node.base / "rabbitmq.conf", "a") as conf:
            conf.write(f"listeners.ssl.default = 127.0.0.1:{ports[0]}\n")
        (node.base / "advanced.config").write_text(
            f'[{{rabbit, [{{ssl_options, [{{cacertfile, "{ca.ca}"}}, {{certfile, "{server.cert}"}}, '
            f'{{keyfile, "{server.key}"}}, {{verify, verify_peer}}, {{fail_if_no_peer_cert, true}}, '
            f'{{crl_check, peer}}, {{crl_cache, {{ssl_crl_hash_dir, {{internal, [{{dir, "{crls}"}}]}}}}}}]}}]}}].\n')

    node = start_private_rabbitmq(folder, configure=configure)
    try:
        yield TlsBroker(node, ports[0], ca, crls)
    finally:
        node.stop()


def handshake_refused(broker: TlsBroker, pair: Pair) -> str:
    """The TLS alert the broker answers `pair`'s handshake with. Read on a bare TLS socket that sends nothing
    after its handshake: a client that went on to write (pika's AMQP header) could make the closing broker
    reset the connection, and a reset throws away the alert still in the client's buffer (seen once under load:
    an EOF instead of the alert)."""
    context = ssl.create_default_context(cafile=str(broker.ca.ca))
    context.load_cert_chain(str(pair.cert), str(pair.key))
    with socket.create_connection(("localhost", broker.port), timeout=30) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls, pytest.raises(ssl.SSLError) as info:
        tls.recv(1)   # TLS 1.3: the client certificate is judged after the client's side of the handshake
    return repr(info.value).upper()


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_broker_refuses_a_revoked_certificates_handshake_once_sync_installs_the_crl(tls_broker, tmp_path,
                                                                                       monkeypatch, capsys):
    site_a = tls_broker.ca.issue("site-a", "site-a", server=False)
    site_b = tls_broker.ca.issue("site-b", "site-b", server=False)
    open_a = tls_broker.connect(site_a)
    tls_broker.connect(site_b).close()

    crl = tmp_path / "crl.pem"
    crl.write_bytes(tls_broker.ca.crl(site_a.cert))   # `provision revoke` writes the kit's
    project = f"rv{secrets.token_hex(3)}"
    definitions_file = tmp_path / "definitions.json"
    definitions_file.write_text(json.dumps(definitions({f"{project}-coordinator": "pw-coordinator"})))
    ctl = Ctl([str(tls_broker.node.scripts / "rabbitmqctl"), "-n", tls_broker.node.name], env=tls_broker.node.env)
    for key, value in tls_broker.node.env.items():
        monkeypatch.setenv(key, value)
    assert main(["broker", "sync", str(definitions_file), "--rabbitmqctl", shlex.join(ctl.command),
                 "--crl", str(crl), "--crl-dir", str(tls_broker.crls)]) == 0
    installed = tls_broker.crls / f"{name_hash(tls_broker.ca.crl_issuer())}.r0"
    assert f"installed {crl} as {installed}" in capsys.readouterr().out
    assert sorted(os.listdir(tls_broker.crls)) == [installed.name]   # replaced whole, no temporary left

    assert "CERTIFICATE_REVOKED" in handshake_refused(tls_broker, site_a)
    tls_broker.connect(site_b).close()
    # the CRL is checked at the handshake only: a connection open before stays open (deleting the site's
    # broker user is what closes it, above)
    open_a.process_data_events(time_limit=0)
    assert open_a.is_open
    open_a.close()
    ctl("delete_user", f"{project}-coordinator")


def test_the_crl_file_name_is_openssls_hash_of_the_issuer(tmp_path):
    import shutil
    import subprocess

    from cryptography import x509

    if shutil.which("openssl") is None:
        missing("openssl is not installed: nothing to compare the CRL file's name with")
    for name in ("fedbroker test CA", "  Cancer   Study\tCA ", "Ärzte CA"):
        ca = Authority(tmp_path / secrets.token_hex(3), name=name)
        path = tmp_path / "crl.pem"
        path.write_bytes(ca.crl())
        expected = subprocess.run(["openssl", "crl", "-hash", "-noout", "-in", str(path)], capture_output=True,
                                  text=True, check=True).stdout.strip()
        assert name_hash(x509.load_pem_x509_crl(path.read_bytes()).issuer) == expected, name
    with pytest.raises(ConfigError, match="is not an X.509 CRL"):
        path.write_text("nonsense")
        install_crl(str(path), str(tmp_path))
    path.write_bytes(ca.crl())
    with pytest.raises(ConfigError, match="is not a folder"):
        install_crl(str(path), str(tmp_path / "absent"))
