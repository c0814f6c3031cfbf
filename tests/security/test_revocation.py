"""Revocation and rotation without a restart (fedbroker.rpc.live_auth): the aggregation service, started for real as
`fedbroker aggregator` on mutual TLS with a token table, follows its CRL (`crl.pem` beside the client CA) and its
token table while it runs. A revoked certificate is refused on its next call, also on a connection opened
before, while everyone else keeps working; a token dropped from the table is refused and a rotated one
accepted; a file that cannot be trusted or read keeps the last good one. Renewed server certificates are served
to new connections."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.errors import Rejection
from fedbroker.job.spec import parse_model
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity, ServerTLS, generate_token, hash_token
from fedbroker.rpc.plumbing import RemoteError
from tests.rabbitmq_node import free_ports
from tests.security.pki import Authority, Pair
from tests.source_roots import PYTHONPATH

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
SITES = ("site-a", "site-b", "site-c")
WAIT_S = 120.0


def weights(v: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((2, 4), v, np.float32), "0.bias": np.full(2, v, np.float32)}


def replace(path: Path, data: bytes) -> None:
    """Write `path` atomically, as provisioning does: a temporary file renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def table_text(entries: dict[str, tuple[str, list[str]]]) -> bytes:
    """A token table: identity → (role, tokens), kept as digests."""
    return yaml.safe_dump({name: {"role": role, "sha256": [hash_token(t) for t in tokens]}
                           for name, (role, tokens) in entries.items()}).encode()


def wait_for(condition: Callable[[], bool], what: str, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {WAIT_S:g} s for {what}; the service's log:\n"
                                 f"{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)


@dataclass
class Service:
    """`fedbroker aggregator` as a process, and what its callers hold."""

    process: subprocess.Popen[bytes]
    target: str
    ca: Authority
    folder: Path
    tokens: dict[str, str]
    certs: dict[str, Pair]
    log: Path

    @property
    def table(self) -> Path:
        return self.folder / "tokens.yaml"

    @property
    def crl(self) -> Path:
        return self.ca.folder / "crl.pem"

    def client(self, identity: str, *, token: str = "") -> AggregatorClient:
        pair = self.certs[identity]
        return AggregatorClient(self.target, timeout_s=10, security=ClientSecurity(
            token=token or self.tokens[identity], ca=self.ca.ca.read_bytes(), cert_chain=pair.cert.read_bytes(),
            private_key=pair.key.read_bytes()))

    def logged(self, text: str) -> bool:
        return text in self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    folder = tmp_path_factory.mktemp("revocation")
    ca = Authority(folder / "ca")
    server = ca.issue("server", "localhost", server=True)
    certs = {who: ca.issue(f"client-{who}", who, server=False) for who in ("coordinator", *SITES)}
    tokens = {who: generate_token() for who in certs}
    (folder / "tokens.yaml").write_bytes(table_text(
        {who: ("coordinator" if who == "coordinator" else "worker", [tokens[who]]) for who in certs}))
    port = free_ports(1)[0]
    config = folder / "aggregator.yaml"
    config.write_text(yaml.safe_dump({"aggregator": {
        "listen": f"127.0.0.1:{port}", "tokens_file": str(folder / "tokens.yaml"),
        "tls": {"cert_file": str(server.cert), "key_file": str(server.key), "client_ca_file": str(ca.ca)}}}))
    log = folder / "aggregator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "fedbroker", "aggregator", "--config", str(config)],
                                   cwd=folder, env={**env, "PYTHONPATH": PYTHONPATH}, stdout=out,
                                   stderr=subprocess.STDOUT)
    found = Service(process, f"localhost:{port}", ca, folder, tokens, certs, log)
    try:
        probe = found.client("coordinator")
        try:
            wait_for(lambda: _ready(probe._replicas.current().channel) or process.poll() is not None, "the service to serve", log)
        finally:
            probe.close()
        assert process.poll() is None, log.read_text(errors="replace")
        with found.client("coordinator") as coordinator:
            coordinator.put_global("j", 1, SPEC.to_json(), weights(1.0))
        yield found
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _ready(channel: grpc.Channel) -> bool:
    future = grpc.channel_ready_future(channel)
    try:
        future.result(timeout=1)
        return True
    except grpc.FutureTimeoutError:
        future.cancel()  # unsubscribes its poller, which would otherwise outlive the channel's close and raise
        return False


def refused(client: AggregatorClient) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        client.download("j")
    return info.value


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_revoked_certificate_is_refused_on_its_next_call_while_the_others_keep_working(service):
    pid = service.process.pid
    with service.client("site-a") as site_a, service.client("site-b") as site_b:
        assert site_a.download("j")[0] == 1 and site_b.download("j")[0] == 1   # the connections are open

        # a CRL the client CA did not sign (a CA of the same name, another key) is not trusted
        impostor = Authority(service.folder / "impostor", name="fedbroker test CA")
        replace(service.crl, impostor.crl(service.certs["site-a"].cert))
        assert site_a.download("j")[0] == 1
        wait_for(lambda: service.logged("the signature does not verify with the client CA's key"),
                 "the service to log the forged CRL", service.log)

        replace(service.crl, service.ca.crl(service.certs["site-a"].cert))
        error = refused(site_a)   # the same open connection: its next call
        assert error.code == grpc.StatusCode.UNAUTHENTICATED and error.reason == Rejection.UNAUTHENTICATED
        assert "certificate revoked" in str(error), error
        assert Rejection.is_final(error.reason)   # a worker gives up its task instead of retrying
        assert site_b.download("j")[0] == 1
    with service.client("site-a") as again:   # a new connection too
        assert "certificate revoked" in str(refused(again))
    with service.client("coordinator") as coordinator:
        coordinator.put_global("j", 2, SPEC.to_json(), weights(2.0))
    with service.client("site-b") as site_b:
        assert site_b.download("j")[0] == 2

    service.crl.unlink()   # a CRL that disappears un-revokes no one
    with service.client("site-a") as site_a:
        assert "certificate revoked" in str(refused(site_a))
    assert service.logged("crl.pem is gone: the last one loaded stays in force")
    assert service.process.poll() is None and service.process.pid == pid


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_token_dropped_from_the_table_is_refused_and_a_rotated_one_accepted_without_a_restart(service):
    others = {who: ("coordinator" if who == "coordinator" else "worker", [service.tokens[who]])
              for who in ("coordinator", "site-a")}
    old, new = service.tokens["site-b"], generate_token()
    with service.client("site-b") as site_b, service.client("site-b", token=new) as rotated, \
            service.client("site-c") as site_c:
        assert site_b.download("j")[0] >= 1 and site_c.download("j")[0] >= 1
        assert "bearer token is not valid" in str(refused(rotated))

        # rotation, step 1: both digests; site-c's token revoked (its entry gone)
        replace(service.table, table_text({**others, "site-b": ("worker", [old, new])}))
        assert rotated.download("j")[0] >= 1 and site_b.download("j")[0] >= 1
        error = refused(site_c)
        assert error.code == grpc.StatusCode.UNAUTHENTICATED and "bearer token is not valid" in str(error)

        # step 2: the old digest removed
        replace(service.table, table_text({**others, "site-b": ("worker", [new])}))
        assert "bearer token is not valid" in str(refused(site_b))
        assert rotated.download("j")[0] >= 1

        # a table that is not valid keeps the last good one, and the log names the problem
        replace(service.table, b"site-b: {role: worker, sha256: [not-a-digest]\n")
        assert rotated.download("j")[0] >= 1
        assert "bearer token is not valid" in str(refused(site_b))
        wait_for(lambda: service.logged("tokens.yaml is not valid YAML"), "the log to name the bad table", service.log)
        replace(service.table, yaml.safe_dump({"site-b": {"role": "worker", "sha256": "abc"}}).encode())
        assert rotated.download("j")[0] >= 1
        wait_for(lambda: service.logged("must be a hex SHA-256 digest"), "the log to name the bad digest", service.log)

        replace(service.table, table_text({**others, "site-b": ("worker", [new]), "site-c": ("worker",
                                                                                            [service.tokens["site-c"]])}))
        assert site_c.download("j")[0] >= 1   # re-admitted by the next good table


@pytest.mark.integration
def test_a_renewed_server_certificate_is_served_to_new_connections_without_a_restart(tmp_path):
    old_ca, new_ca = Authority(tmp_path / "old"), Authority(tmp_path / "new", name="renewed CA")
    clients = Authority(tmp_path / "clients", name="client CA")
    first = old_ca.issue("server", "localhost", server=True)
    served = tmp_path / "served"
    served.mkdir()
    cert, key = served / "server.crt", served / "server.key"
    replace(cert, first.cert.read_bytes())
    replace(key, first.key.read_bytes())
    tokens = {"w": generate_token()}
    table = tmp_path / "tokens.yaml"
    table.write_bytes(table_text({"w": ("worker", [tokens["w"]])}))
    from fedbroker.rpc.live_auth import follow_table

    tls = ServerTLS.from_files(str(cert), str(key), str(clients.ca), where="aggregator.tls")
    server, port = serve(RoundBook(), tokens=follow_table(str(table), service="test"), tls=tls)
    pair = clients.issue("w", "w", server=False)

    def trusting(authority: Authority) -> AggregatorClient:
        return AggregatorClient(f"localhost:{port}", timeout_s=5, security=ClientSecurity(
            token=tokens["w"], ca=authority.ca.read_bytes(), cert_chain=pair.cert.read_bytes(),
            private_key=pair.key.read_bytes()))

    def status(client: AggregatorClient) -> grpc.StatusCode | None:
        try:
            client.download("none")
        except RemoteError as exc:
            return exc.code
        return None

    try:
        with trusting(old_ca) as client:
            assert status(client) == grpc.StatusCode.NOT_FOUND   # served: past TLS and the token
        with trusting(new_ca) as client:
            assert status(client) == grpc.StatusCode.UNAVAILABLE  # the server's certificate is not its CA's
        renewed = new_ca.issue("server", "localhost", server=True)
        replace(key, renewed.key.read_bytes())   # the key first: a handshake between the two keeps the old pair
        replace(cert, renewed.cert.read_bytes())
        with trusting(new_ca) as client:
            assert status(client) == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(grace=0)


# ----- the rules, without a network ---------------------------------------------------------------------


def test_a_token_table_that_is_invalid_at_start_stops_the_service(tmp_path):
    from fedbroker.errors import ConfigError
    from fedbroker.rpc.live_auth import follow_table

    bad = tmp_path / "tokens.yaml"
    bad.write_text("w: {role: worker, sha256: nope}\n")
    with pytest.raises(ConfigError, match="must be a hex SHA-256 digest"):
        follow_table(str(bad), service="svc")
    with pytest.raises(ConfigError, match="cannot read the token table"):
        follow_table(str(tmp_path / "absent.yaml"), service="svc")


def test_a_crl_is_trusted_only_from_the_client_ca_and_lists_only_its_serials(tmp_path):
    from fedbroker.errors import ConfigError
    from fedbroker.rpc.live_auth import load_cas, load_crl

    ca, other = Authority(tmp_path / "ca"), Authority(tmp_path / "other", name="other CA")
    revoked, kept = ca.issue("a", "site-a", server=False), ca.issue("b", "site-b", server=False)
    cas = load_cas(ca.ca.read_bytes(), where="client_ca_file")
    (tmp_path / "crl.pem").write_bytes(other.crl())
    with pytest.raises(ConfigError, match="issued by 'CN=other CA', which is not the client CA"):
        load_crl(str(tmp_path / "crl.pem"), cas)
    (tmp_path / "crl.pem").write_bytes(b"-----BEGIN X509 CRL-----\nnot base64\n-----END X509 CRL-----\n")
    with pytest.raises(ConfigError, match="is not an X.509 CRL"):
        load_crl(str(tmp_path / "crl.pem"), cas)
    (tmp_path / "crl.pem").write_bytes(ca.crl(revoked.cert))
    listed = load_crl(str(tmp_path / "crl.pem"), cas)
    from cryptography import x509

    def key(pair: Pair) -> tuple[bytes, int]:
        cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
        return cert.issuer.public_bytes(), cert.serial_number

    assert listed.revoked_at(*key(revoked)) is not None and listed.revoked_at(*key(kept)) is None
    foreign = other.issue("a", "site-a", server=False)   # another issuer's certificate, whatever its serial
    assert listed.revoked_at(key(foreign)[0], key(revoked)[1]) is None


def test_a_half_renewed_key_and_certificate_are_not_served_until_they_match(tmp_path):
    from fedbroker.rpc.live_auth import _CertificateFiles

    ca = Authority(tmp_path / "ca")
    first, second = ca.issue("one", "localhost", server=True), ca.issue("two", "localhost", server=True)
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    replace(cert, first.cert.read_bytes())
    replace(key, first.key.read_bytes())
    fetch = _CertificateFiles(ServerTLS.from_files(str(cert), str(key), where="tls"))
    assert fetch() is None                          # unchanged
    replace(cert, second.cert.read_bytes())         # the certificate renewed, its key not yet
    assert fetch() is None
    replace(key, second.key.read_bytes())
    assert fetch() is not None                      # the matching pair, once
    assert fetch() is None


def test_a_refused_change_is_counted_and_logged_once_and_the_next_good_one_loads(tmp_path, caplog):
    from prometheus_client import REGISTRY

    from fedbroker.rpc.live_auth import LiveTokenTable

    def refused() -> float:
        return REGISTRY.get_sample_value("fedbroker_auth_file_reloads_total",
                                         {"kind": "tokens", "outcome": "refused"}) or 0.0

    token, rotated = generate_token(), generate_token()
    path = tmp_path / "tokens.yaml"
    path.write_bytes(table_text({"w": ("worker", [token])}))
    table = LiveTokenTable(str(path))
    before = refused()
    replace(path, b"{}\n")   # an empty table: authentication would be off, so it is refused
    for _ in range(3):
        assert table.identify(token) is not None
    assert refused() == before + 1
    assert [r.message for r in caplog.records].count(
        f"tokens {path} changed but cannot be used, the last good one stays in force: tokens: the token table is "
        f"empty; leave the tokens file unset to turn auth off") == 1
    replace(path, table_text({"w": ("worker", [rotated])}))
    assert table.identify(rotated) is not None and table.identify(token) is None


@pytest.mark.integration
def test_the_coordinators_port_refuses_a_revoked_scientist_and_serves_the_others(tmp_path):
    from fedbroker.bus import InProcessBus
    from fedbroker.coordinator.scheduler import Coordinator
    from fedbroker.coordinator.service import CoordinatorClient
    from fedbroker.coordinator.service import serve as serve_coordinator
    from fedbroker.coordinator.store import StateStore
    from fedbroker.rpc.live_auth import follow_table

    ca = Authority(tmp_path / "ca")
    server_pair = ca.issue("server", "localhost", server=True)
    people = {"sci": "submitter", "eve": "viewer"}
    pairs = {who: ca.issue(who, who, server=False) for who in people}
    tokens = {who: generate_token() for who in people}
    table = tmp_path / "tokens.yaml"
    table.write_bytes(table_text({who: (role, [tokens[who]]) for who, role in people.items()}))
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    coordinator = Coordinator(bus=InProcessBus(namespace="revocation"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"))
    server, port = serve_coordinator(coordinator, tokens=follow_table(str(table), service="coordinator"),
                                     tls=ServerTLS.from_files(str(server_pair.cert), str(server_pair.key), str(ca.ca),
                                                              where="coordinator.tls"))
    clients = {who: CoordinatorClient(f"localhost:{port}", timeout_s=10, security=ClientSecurity(
        token=tokens[who], ca=ca.ca.read_bytes(), cert_chain=pairs[who].cert.read_bytes(),
        private_key=pairs[who].key.read_bytes())) for who in people}
    try:
        assert not clients["sci"].status().jobs and not clients["eve"].status().jobs
        replace(ca.folder / "crl.pem", ca.crl(pairs["sci"].cert))
        with pytest.raises(grpc.RpcError) as info:
            clients["sci"].status()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "certificate revoked" in info.value.details()
        assert not clients["eve"].status().jobs
    finally:
        for client in clients.values():
            client.close()
        server.stop(grace=0)
        store.close()
