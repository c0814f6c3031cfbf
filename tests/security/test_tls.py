"""TLS on both transports, and credentials kept out of the logs.

A whole federation runs with mutual TLS and bearer tokens on gRPC and AMQP over TLS (amqps:// through a
TLS-terminating proxy in front of the shared RabbitMQ, so the broker's configuration is untouched); a
client that does not trust the server, or a server that does not trust the client, gets no connection."""

from __future__ import annotations

import logging
import time
import uuid

import grpc
import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import delete_topology, open_bus
from fedbroker.errors import BusError, ConfigError
from fedbroker.job.spec import parse_job, parse_model
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity, ServerTLS, TokenTable, generate_token, hash_token
from fedbroker.rpc.plumbing import RemoteError
from tests.security.conftest import SecureFederation, amqps_url
from tests.security.tlsproxy import TlsProxy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

JOB = {
    "name": "tls", "category": "digits", "seed": 3,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 16}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 16, "out_features": 10}]},
    "training": {"rounds": 2, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "schedule": {"min_workers": 2, "wait_for_workers_s": 30, "round_timeout_s": 60},
}
SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}


@pytest.fixture(scope="module")
def secure_run(pki, tls_proxy, rabbitmq_url, tmp_path_factory):
    """One federation run, everything logged at DEBUG: (federation, job id, log text, tokens)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep(level=logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    connections = tls_proxy.connections
    fed = SecureFederation(amqps_url(tls_proxy), pki.ca, pki, tmp_path_factory.mktemp("secure"), ["w0", "w1"])
    try:
        job_id = fed.coordinator.submit(parse_job(JOB))
        status = fed.coordinator.wait(job_id, timeout=150)
        assert status == "completed", fed.store.job(job_id).error
        # a failing connection with a password of its own: error paths must not print it either
        leaky = open_bus("amqp://fedbroker:Sup3r-S3cret-Passw0rd@127.0.0.1:1/%2F", namespace=fed.namespace,
                         reconnect_initial_s=0.05, publish_timeout_s=0.5)
        with pytest.raises(BusError):
            leaky.publish_control(b"x")
        leaky.close()
        yield fed, job_id, "\n".join(records), tls_proxy.connections - connections
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        fed.close(rabbitmq_url)


def test_a_federation_runs_over_mutual_tls_grpc_and_amqps(secure_run):
    fed, job_id, _, connections = secure_run
    rounds = fed.store.rounds(job_id)
    assert [r.status for r in rounds] == ["closed", "closed"] and all(r.aggregated == 2 for r in rounds)
    assert connections >= 6  # coordinator and both workers: a publisher and a consumer connection each
    version, _, weights = fed.book.global_model(job_id)
    assert version == 3 and all(np.isfinite(a).all() for a in weights.values())


def test_no_token_and_no_broker_password_appear_in_the_logs_of_a_round(secure_run):
    fed, _, text, _ = secure_run
    assert "round 2 of" in text and "closed" in text  # the capture did see the round
    for identity, token in fed.tokens.items():
        assert token not in text, f"{identity}'s token is in the log"
        assert hash_token(token) not in text
    assert "guest:guest" not in text and ":guest@" not in text
    assert "Sup3r-S3cret-Passw0rd" not in text
    # the failing connection is named by where it goes and who logs in, never by its URL
    assert "cannot reach the broker at 127.0.0.1:1 (virtual host /, user fedbroker)" in text
    assert repr(fed.workers["w0"].config).count(fed.tokens["w0"]) == 0  # a logged config shows no token


# ----- refusals ------------------------------------------------------------------------------------


@pytest.fixture
def tls_service(pki):
    table = TokenTable.from_mapping({"coordinator": {"role": "coordinator", "sha256": hash_token("c" * 32)}})
    book = RoundBook()
    server, port = serve(book, tokens=table, tls=ServerTLS.from_files(
        str(pki.server.cert), str(pki.server.key), str(pki.ca), where="aggregator.tls"))
    yield f"localhost:{port}", book
    server.stop(grace=0)


def _client(target, pki, *, ca=None, pair="coordinator", token="c" * 32):
    cert = getattr(pki, pair) if pair else None
    security = ClientSecurity(token=token, ca=(ca or pki.ca).read_bytes(),
                              cert_chain=cert.cert.read_bytes() if cert else None,
                              private_key=cert.key.read_bytes() if cert else None)
    return AggregatorClient(target, security=security, timeout_s=3)


def test_mutual_tls_with_a_token_serves_the_coordinator(tls_service, pki):
    target, _book = tls_service
    with _client(target, pki) as client:
        client.put_global("j", 1, SPEC.to_json(), {"0.weight": np.zeros((2, 4), np.float32),
                                                   "0.bias": np.zeros(2, np.float32)})
        assert client.download("j")[0] == 1


@pytest.mark.parametrize("case", ["plaintext", "untrusted server", "no client certificate"])
def test_a_peer_without_the_right_certificates_gets_no_connection(tls_service, pki, case):
    target, _ = tls_service
    if case == "plaintext":
        client = AggregatorClient(target, timeout_s=2)
    elif case == "untrusted server":
        client = _client(target, pki, ca=pki.rogue_ca)
    else:
        client = _client(target, pki, pair=None)
    started = time.monotonic()
    with client, pytest.raises(RemoteError) as info:
        client.status("j", 1)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
    assert time.monotonic() - started < 30


def test_a_token_is_only_sent_to_the_configured_service(pki):
    security = ClientSecurity(token=generate_token(), expected_target="aggregator:50051")
    with pytest.raises(ConfigError, match="refusing to send"):
        AggregatorClient("evil.example:50051", security=security)


def test_amqps_checks_the_broker_certificate_and_its_host_name(tls_proxy, pki, rabbitmq_url, caplog):
    namespace = f"fedbroker-sec-{uuid.uuid4().hex[:8]}"
    misnamed_proxy = TlsProxy(pki.misnamed.cert, pki.misnamed.key)  # trusted CA, certificate for another host
    quick = {"namespace": namespace, "publish_timeout_s": 1, "reconnect_initial_s": 0.05}
    trusted = open_bus(amqps_url(tls_proxy), namespace=namespace, ca_file=str(pki.ca), publish_timeout_s=5)
    refused = [open_bus(amqps_url(tls_proxy), ca_file=str(pki.rogue_ca), **quick),      # untrusted CA
               open_bus(amqps_url(tls_proxy), **quick),                                  # system CAs only
               open_bus(amqps_url(misnamed_proxy), ca_file=str(pki.ca), **quick)]        # wrong host name
    try:
        trusted.publish_control(b"hello over TLS")  # confirmed by the broker
        for bus in refused:
            with pytest.raises(BusError, match="timed out"):
                bus.publish_control(b"must not go out")
        assert "Hostname mismatch" in caplog.text  # the misnamed proxy was reached, and its certificate refused
    finally:
        for bus in (trusted, *refused):
            bus.close()
        misnamed_proxy.close()
        delete_topology(rabbitmq_url, namespace, [])


def test_tls_settings_with_a_plaintext_broker_url_are_an_error(pki):
    with pytest.raises(ConfigError, match="amqps://"):
        open_bus("amqp://guest:guest@127.0.0.1:5672/%2F", ca_file=str(pki.ca))
