"""Certificate and token name one identity: on a mutual-TLS port, the client certificate's identity (its CN,
which `fedbroker provision` sets to the participant's name) must be the identity of the bearer token, on both
gRPC services; a mismatch is PERMISSION_DENIED naming both. A port without a client CA stays token-only.

The two services run as processes started from a provisioned server kit's own scripts; every caller uses a
kit's own certificate, key and token, mixed the way a holder of one participant's credentials and another's
token would mix them. Only the coordinator's broker leg is pointed at the shared plain RabbitMQ (the kit's
broker users and AMQPS are tests/lifecycle/test_provision.py's business)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.app.provision import parse_project, provision
from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.errors import Rejection
from fedbroker.job.spec import parse_model
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity, ServerAuth, ServerTLS, certificate_identity
from fedbroker.rpc.plumbing import RemoteError, reason_of
from tests.installed import install
from tests.integration.processes import stop_all
from tests.security.conftest import token_table
from tests.source_roots import PYTHONPATH

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
SITES = ("site-a", "site-b")
JOB = {"name": "bound", "category": "digits", "seed": 0,
       "model": {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"},
                                                      {"type": "Linear", "in_features": 64, "out_features": 10}]},
       "training": {"rounds": 1, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
       "schedule": {"min_workers": 1, "wait_for_workers_s": 60, "round_timeout_s": 60}}


def weights(v: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((2, 4), v, np.float32), "0.bias": np.full(2, v, np.float32)}


# ----- the services from a provisioned kit, as processes --------------------------------------------


@dataclass(frozen=True)
class Kits:
    root: Path
    aggregator: str   # targets, by the name the server certificates carry
    coordinator: str

    def folder(self, identity: str) -> Path:
        if identity == "coordinator":
            return self.root / "server"
        return self.root / ("sites" if identity in SITES else "scientists") / identity

    def security(self, *, cert_of: str, token_of: str) -> ClientSecurity:
        """`cert_of`'s certificate and key (mutual TLS) with `token_of`'s bearer token, each from its own kit."""
        cert = self.folder(cert_of) / ("tls/coordinator-client" if cert_of == "coordinator" else "tls/client")
        token = self.folder(token_of) / ("secrets/coordinator.token" if token_of == "coordinator" else "secrets/token")
        return ClientSecurity(token=token.read_text().strip(), ca=(self.root / "ca/ca.crt").read_bytes(),
                              cert_chain=cert.with_suffix(".crt").read_bytes(),
                              private_key=cert.with_suffix(".key").read_bytes())

    def aggregator_client(self, *, cert_of: str, token_of: str) -> AggregatorClient:
        return AggregatorClient(self.aggregator, security=self.security(cert_of=cert_of, token_of=token_of),
                                timeout_s=10)

    def coordinator_client(self, *, cert_of: str, token_of: str) -> CoordinatorClient:
        return CoordinatorClient(self.coordinator, security=self.security(cert_of=cert_of, token_of=token_of),
                                 timeout_s=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(script: Path, logs: Path, **settings: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env.update(settings, FEDBROKER=f"{sys.executable} -m fedbroker", PYTHONPATH=PYTHONPATH)
    log = open(logs / f"{script.stem}.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([str(script)], cwd=logs, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_serving(kits: Kits, processes: list[subprocess.Popen[bytes]], logs: Path) -> None:
    deadline = time.monotonic() + 120
    for target in (kits.aggregator, kits.coordinator):
        credentials = kits.security(cert_of="coordinator", token_of="coordinator")
        channel = credentials.channel(target, [])
        try:
            while True:
                try:
                    grpc.channel_ready_future(channel).result(timeout=1)
                    break
                except grpc.FutureTimeoutError:
                    alive = all(p.poll() is None for p in processes)
                    if not alive or time.monotonic() > deadline:
                        raise AssertionError("\n".join(p.read_text(errors="replace")[-3000:]
                                                       for p in sorted(logs.glob("*.log")))) from None
        finally:
            channel.close()


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory, rabbitmq_url: str) -> Iterator[Kits]:
    from fedbroker.bus import delete_topology

    root = tmp_path_factory.mktemp("bound")
    ports = {"coordinator_port": _free_port(), "aggregator_port": _free_port(), "broker_port": _free_port()}
    namespace = f"fedbroker-bound{ports['coordinator_port']}"
    provision(parse_project({
        "name": "bound", "server": {"host": "localhost", "listen": "127.0.0.1", "namespace": namespace, **ports,
                                    "aggregator_metrics_port": 0, "coordinator_metrics_port": 0},
        "sites": [{"name": name} for name in SITES],
        "scientists": [{"name": "sci"}, {"name": "eve", "role": "viewer"}],
    }), root / "kits")
    logs = root / "logs"
    logs.mkdir()
    broker = {f"FEDBROKER__BROKER__{key}": "" for key in ("URL_FILE", "CA_FILE", "CERT_FILE", "KEY_FILE")}
    processes = [_start(root / "kits/server/start-aggregator.sh", logs),
                 _start(root / "kits/server/start-coordinator.sh", logs, **broker, FEDBROKER__BROKER__URL=rabbitmq_url)]
    found = Kits(root / "kits", f"localhost:{ports['aggregator_port']}", f"localhost:{ports['coordinator_port']}")
    try:
        _wait_serving(found, processes, logs)
        yield found
    finally:
        stop_all(processes)
        delete_topology(rabbitmq_url, namespace, [])


def _refused(info: pytest.ExceptionInfo[RemoteError], certificate: str, token: str) -> None:
    error = info.value
    assert error.code == grpc.StatusCode.PERMISSION_DENIED and error.reason == Rejection.PERMISSION_DENIED, error
    assert f"certificate names {certificate!r} but the bearer token names {token!r}" in str(error), error


@pytest.mark.integration
@pytest.mark.timeout(300)
class TestProvisionedServices:
    def test_each_participant_is_served_with_its_own_certificate_and_token(self, kits):
        with kits.aggregator_client(cert_of="coordinator", token_of="coordinator") as coordinator:
            coordinator.put_global("shared", 1, SPEC.to_json(), weights(1.0))
        for site in SITES:
            with kits.aggregator_client(cert_of=site, token_of=site) as client:
                assert client.download("shared")[0] == 1
        for person in ("sci", "eve"):
            client = kits.coordinator_client(cert_of=person, token_of=person)
            assert not client.status().jobs  # served (nothing submitted yet), not refused
            client.close()

    def test_one_sites_certificate_with_another_sites_token_is_refused_naming_both(self, kits):
        with kits.aggregator_client(cert_of="coordinator", token_of="coordinator") as coordinator:
            coordinator.put_global("a-only", 1, SPEC.to_json(), weights(2.0))
        with kits.aggregator_client(cert_of="site-a", token_of="site-b") as client, \
                pytest.raises(RemoteError) as info:
            client.download("a-only")
        _refused(info, "site-a", "site-b")
        assert Rejection.is_final(info.value.reason)  # a worker gives up on the task, it does not retry

    def test_a_scientists_certificate_with_a_sites_token_is_refused(self, kits):
        with kits.aggregator_client(cert_of="sci", token_of="site-a") as client, pytest.raises(RemoteError) as info:
            client.download("shared")
        _refused(info, "sci", "site-a")

    def test_a_sites_certificate_with_the_coordinators_token_cannot_install_a_model(self, kits):
        with kits.aggregator_client(cert_of="coordinator", token_of="coordinator") as coordinator:
            coordinator.put_global("kept", 1, SPEC.to_json(), weights(3.0))
            with kits.aggregator_client(cert_of="site-a", token_of="coordinator") as forger, \
                    pytest.raises(RemoteError) as info:
                forger.put_global("kept", 2, SPEC.to_json(), weights(-1.0))
            _refused(info, "site-a", "coordinator")
            version, _, tensors = coordinator.download("kept")
        assert version == 1 and float(tensors["0.bias"][0]) == 3.0

    @pytest.mark.parametrize("cert_of", ["eve", "site-a"])
    def test_the_coordinator_refuses_a_submitters_token_with_anyone_elses_certificate(self, kits, cert_of):
        client = kits.coordinator_client(cert_of=cert_of, token_of="sci")
        try:
            with pytest.raises(grpc.RpcError) as info:
                client.submit(json.dumps(JOB))
        finally:
            client.close()
        error = info.value
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and reason_of(error) == Rejection.PERMISSION_DENIED
        assert f"certificate names {cert_of!r} but the bearer token names 'sci'" in error.details()
        sci = kits.coordinator_client(cert_of="sci", token_of="sci")
        assert not sci.status().jobs  # nothing was submitted
        sci.close()


    def test_a_sites_kit_reads_only_its_own_record_and_nothing_else_on_the_coordinator(self, kits):
        """With its own certificate and token a site is admitted to SiteRecord for itself (NOT_FOUND: it never
        registered here, so the call got past authentication), refused for another site and for Status; its
        certificate with another site's token is refused naming both."""
        client = kits.coordinator_client(cert_of="site-a", token_of="site-a")
        try:
            with pytest.raises(grpc.RpcError) as own:
                client.site_record("site-a")
            assert own.value.code() == grpc.StatusCode.NOT_FOUND, own.value.details()
            assert "no worker 'site-a' is registered" in own.value.details()
            with pytest.raises(grpc.RpcError) as other:
                client.site_record("site-b")
            assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "'site-a' may read only its own record, not worker 'site-b'" in other.value.details()
            with pytest.raises(grpc.RpcError) as status:
                client.status()
            assert status.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "'site-a' (role worker) may not call Status" in status.value.details()
        finally:
            client.close()
        mixed = kits.coordinator_client(cert_of="site-a", token_of="site-b")
        try:
            with pytest.raises(grpc.RpcError) as info:
                mixed.site_record("site-b")
        finally:
            mixed.close()
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "certificate names 'site-a' but the bearer token names 'site-b'" in info.value.details()


# ----- a TLS port without a client CA: the token alone, as before -------------------------------------


@pytest.mark.integration
def test_a_tls_port_without_a_client_ca_asks_for_no_certificate_and_the_token_names_the_caller(pki):
    table, tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
    server, port = serve(RoundBook(), tokens=table, tls=ServerTLS(pki.server.cert.read_bytes(),
                                                                  pki.server.key.read_bytes()))
    target = f"localhost:{port}"
    try:
        with AggregatorClient(target, timeout_s=5, security=ClientSecurity(
                token=tokens["coordinator"], ca=pki.ca.read_bytes())) as coordinator:
            coordinator.put_global("j", 1, SPEC.to_json(), weights(0.0))
            install(coordinator, "j", {"alignment": "none", "weighting": "fedavg", "selection": "all"})
            coordinator.open_round("j", 1, ["w2"], 4e9, seed=0)
        w1 = pki.client("w1")  # offered, never asked for: w2's token decides, as on a port without mTLS
        with AggregatorClient(target, timeout_s=5, security=ClientSecurity(
                token=tokens["w2"], ca=pki.ca.read_bytes(), cert_chain=w1.cert.read_bytes(),
                private_key=w1.key.read_bytes())) as client:
            client.upload(job_id="j", round=1, worker_id="w2", num_samples=1, tensors=weights(1.0))
            assert client.status("j", 1) == (["w2"], True)
    finally:
        server.stop(grace=0)


# ----- the rule, without a network -------------------------------------------------------------------


def _certificate(*common_names: str, san: str = "") -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedbroker tests"),
                         *(x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in common_names)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now)
               .not_valid_after(now + datetime.timedelta(days=1)))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_the_certificates_identity_is_its_one_common_name():
    assert certificate_identity({"x509_pem_cert": [_certificate("site-a", san="site-b")]}) == "site-a"  # SAN unread
    assert certificate_identity({"x509_pem_cert": [_certificate()]}) == ""                   # names no one
    assert certificate_identity({"x509_pem_cert": [_certificate("site-a", "site-b")]}) == ""  # names two
    assert certificate_identity({"transport_security_type": [b"ssl"]}) is None              # TLS, no certificate
    assert certificate_identity({}) is None                                                  # plaintext


def test_a_certificate_that_names_no_one_or_someone_else_is_refused_before_the_role_is_checked():
    table, tokens = token_table({"site-a": "worker", "site-b": "worker"})
    auth = ServerAuth(table, {"DownloadGlobalModel": frozenset({"worker"})}, service="svc")
    assert auth.check("DownloadGlobalModel", tokens["site-a"], "site-a") is None
    assert auth.check("DownloadGlobalModel", tokens["site-a"], None) is None  # no mTLS: the token alone
    code, reason, message = auth.check("OpenRound", tokens["site-a"], "site-b")
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, Rejection.PERMISSION_DENIED)
    assert message == ("svc/OpenRound: the client certificate names 'site-b' but the bearer token names 'site-a': "
                       "certificate and token must name the same identity")
    assert "names no identity" in auth.check("DownloadGlobalModel", tokens["site-a"], "")[2]
