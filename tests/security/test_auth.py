"""Authentication and where credentials come from: the token table, the roles of the aggregation service and
the coordinator, and secrets read from the environment or mounted files (never from code, never printed)."""

from __future__ import annotations

import hmac

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.app.launch import broker_url, client_security, start_aggregator
from fedbroker.config import load_config
from fedbroker.errors import ConfigError, Rejection
from fedbroker.job.spec import parse_model
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity, TokenTable, generate_token, hash_token
from fedbroker.rpc.plumbing import RemoteError
from tests.installed import install
from tests.security.conftest import token_table, write_table

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}


def weights(v: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((2, 4), v, np.float32), "0.bias": np.full(2, v, np.float32)}


# ----- the token table -----------------------------------------------------------------------------


def test_a_token_table_maps_tokens_to_identities_by_digest_or_plain_token(tmp_path):
    coordinator, worker, old = generate_token(), generate_token(), generate_token()
    path = tmp_path / "tokens.yaml"
    path.write_text(f"coordinator: {{role: coordinator, sha256: {hash_token(coordinator)}}}\n"
                    f"hospital-a: {{role: worker, sha256: [{hash_token(worker)}, {hash_token(old).upper()}]}}\n"
                    f"alice: {{role: submitter, token: {'x' * 20}}}\n")
    table = TokenTable.from_file(str(path))
    assert table.identify(coordinator).name == "coordinator" and table.identify(coordinator).role == "coordinator"
    assert table.identify(worker).name == table.identify(old).name == "hospital-a"  # a rotation in progress
    assert table.identify("x" * 20).role == "submitter"
    assert table.identify("x" * 19) is None and table.identify("") is None
    assert hash_token(coordinator) not in repr(table) and "4 tokens" in repr(table)


def test_a_lookup_compares_the_token_with_every_entry(monkeypatch):
    table, tokens = token_table({f"w{i}": "worker" for i in range(5)})
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert table.identify(tokens["w0"]).name == "w0"  # the first entry matches: no early exit all the same
    assert len(calls) == 5


@pytest.mark.parametrize("raw, field", [
    ({"w": {"role": "admin", "sha256": "0" * 64}}, "w.role"),
    ({"w": {"role": "worker", "token": "short"}}, "w.token"),
    ({"w": {"role": "worker", "sha256": "xyz"}}, "w.sha256"),
    ({"w": {"role": "worker", "sha256": "0" * 64, "token": "y" * 20}}, "tokens.w"),
    ({"w": {"role": "worker"}}, "tokens.w"),
    ({"w": {"role": "worker", "sha256": "0" * 64, "extra": 1}}, "tokens.w"),
    ({"a": {"role": "worker", "sha256": "0" * 64}, "b": {"role": "worker", "sha256": "0" * 64}}, "tokens.b"),
    ({"../x": {"role": "worker", "sha256": "0" * 64}}, "tokens.../x"),
    ({}, "tokens"),
    (["coordinator"], "tokens"),
])
def test_a_bad_token_table_is_refused_naming_the_entry(raw, field):
    with pytest.raises(ConfigError) as info:
        TokenTable.from_mapping(raw)
    assert info.value.field.endswith(field), str(info.value)


def test_a_missing_token_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the token table"):
        TokenTable.from_file(str(tmp_path / "nope.yaml"))


# ----- roles on the aggregation service -------------------------------------------------------------


@pytest.fixture
def service():
    table, tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
    server, port = serve(RoundBook(), tokens=table)
    target = f"127.0.0.1:{port}"
    clients = {name: AggregatorClient(target, timeout_s=5, security=ClientSecurity(token=token))
               for name, token in tokens.items()}
    yield target, clients
    for client in clients.values():
        client.close()
    server.stop(grace=0)


@pytest.mark.integration
def test_with_tokens_a_round_runs_and_each_worker_sees_only_itself(service):
    _target, c = service
    c["coordinator"].put_global("j", 1, SPEC.to_json(), weights(0.0))
    install(c["coordinator"], "j", AGG)
    c["coordinator"].open_round("j", 1, ["w1", "w2"], 4e9, seed=0)
    assert c["w1"].download("j")[0] == 1
    c["w1"].upload(job_id="j", round=1, worker_id="w1", num_samples=1, tensors=weights(1.0))
    c["w2"].upload(job_id="j", round=1, worker_id="w2", num_samples=3, tensors=weights(3.0))
    assert c["coordinator"].status("j", 1) == (["w1", "w2"], True)
    assert c["w1"].status("j", 1) == (["w1"], True)  # peers' ids are not a worker's business
    c["coordinator"].close_round("j", 1)
    np.testing.assert_allclose(c["w2"].download("j")[2]["0.bias"], 2.5)


@pytest.mark.integration
def test_health_checks_need_no_token(service):
    target, _ = service
    with grpc.insecure_channel(target) as channel:  # Kubernetes' gRPC probes send no metadata
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.integration
def test_a_worker_refused_by_auth_gives_up_at_once(service):
    """unauthenticated/permission_denied are final: the worker reports the task instead of retrying it."""
    target, c = service
    c["coordinator"].put_global("k", 1, SPEC.to_json(), weights(0.0))
    bad = AggregatorClient(target, timeout_s=5, security=ClientSecurity(token=generate_token()))
    with pytest.raises(RemoteError) as info:
        bad.download("k")
    assert info.value.reason == "unauthenticated" and Rejection.is_final(info.value.reason)
    assert Rejection.is_final("permission_denied")


# ----- credentials from the environment and files, kept out of reprs and logs -----------------------


def test_secrets_come_from_env_or_files_and_stay_out_of_reprs(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(" fbt_from-a-file \n")
    url_file = tmp_path / "url"
    url_file.write_text("amqps://fedbroker:pa55word@rabbitmq:5671/%2F\n")
    config = load_config(environ={"FEDBROKER__CLIENT__TOKEN_FILE": str(token_file),
                                  "FEDBROKER__BROKER__URL_FILE": str(url_file),
                                  "FEDBROKER__WORKER__ID": "007"})
    assert client_security(config).token == "fbt_from-a-file"
    assert broker_url(config) == "amqps://fedbroker:pa55word@rabbitmq:5671/%2F"
    assert config.worker.id == "007"  # an environment value for a text setting stays text
    config = load_config(environ={"FEDBROKER__CLIENT__TOKEN": "123456789012345678",
                                  "FEDBROKER__BROKER__URL": "amqp://u:pa55word@h/"})
    assert config.client.token == "123456789012345678"
    shown = repr(config) + repr(client_security(config))
    assert "123456789012345678" not in shown and "pa55word" not in shown


def test_a_secret_given_twice_or_unreadable_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="either client.token or client.token_file"):
        client_security(load_config(environ={"FEDBROKER__CLIENT__TOKEN": "t" * 20,
                                             "FEDBROKER__CLIENT__TOKEN_FILE": str(tmp_path / "t")}))
    with pytest.raises(ConfigError, match=r"client\.token_file"):
        client_security(load_config(environ={"FEDBROKER__CLIENT__TOKEN_FILE": str(tmp_path / "missing")}))
    with pytest.raises(ConfigError, match=r"client\.ca_file"):
        client_security(load_config(environ={"FEDBROKER__CLIENT__CA_FILE": str(tmp_path / "missing.pem")}))


@pytest.mark.integration
def test_the_aggregator_process_loads_its_token_table_and_tls_from_config(tmp_path, pki):
    tokens = write_table(tmp_path / "tokens.yaml", {"coordinator": "coordinator"})
    config = load_config(environ={
        "FEDBROKER__AGGREGATOR__LISTEN": "127.0.0.1:0",
        "FEDBROKER__AGGREGATOR__TOKENS_FILE": str(tmp_path / "tokens.yaml"),
        "FEDBROKER__AGGREGATOR__TLS__CERT_FILE": str(pki.server.cert),
        "FEDBROKER__AGGREGATOR__TLS__KEY_FILE": str(pki.server.key),
    })
    server, port = start_aggregator(config)
    try:
        target = f"localhost:{port}"
        good = load_config(environ={"FEDBROKER__CLIENT__TOKEN": tokens["coordinator"],
                                    "FEDBROKER__CLIENT__CA_FILE": str(pki.ca)})
        with AggregatorClient(target, timeout_s=5, security=client_security(good)) as client:
            client.put_global("j", 1, SPEC.to_json(), weights(0.0))
        anonymous = load_config(environ={"FEDBROKER__CLIENT__CA_FILE": str(pki.ca)})
        with AggregatorClient(target, timeout_s=5, security=client_security(anonymous)) as client, \
                pytest.raises(RemoteError, match="UNAUTHENTICATED"):
            client.download("j")
    finally:
        server.stop(grace=0)


def test_tls_settings_must_come_in_pairs(tmp_path, pki):
    with pytest.raises(ConfigError, match="both cert_file and key_file"):
        start_aggregator(load_config(environ={"FEDBROKER__AGGREGATOR__LISTEN": "127.0.0.1:0",
                                              "FEDBROKER__AGGREGATOR__TLS__CERT_FILE": str(pki.server.cert)}))
    with pytest.raises(ConfigError, match="mTLS needs TLS"):
        start_aggregator(load_config(environ={"FEDBROKER__AGGREGATOR__LISTEN": "127.0.0.1:0",
                                              "FEDBROKER__AGGREGATOR__TLS__CLIENT_CA_FILE": str(pki.ca)}))
