"""A job's settings installed once at the real gRPC service (`InstallJob`): idempotent, other settings refused,
kept in the spool across a restart, given back only to the job's participants, installed by the coordinator only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.job.settings import sections_settings, settings_digest
from fedbroker.job.spec import parse_model
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import RemoteError
from tests.security.conftest import token_table

pytestmark = pytest.mark.integration

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
ROBUST = {"robust": "trimmed_mean", "robust_params": {"beta": 0.2}}


def weights(v: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((2, 4), v, np.float32), "0.bias": np.full(2, v, np.float32)}


class Service:
    def __init__(self, spool: Path) -> None:
        table, self.tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
        self.book = RoundBook(spool_dir=spool)
        self.server, port = serve(self.book, tokens=table)
        self.clients = {name: AggregatorClient(f"127.0.0.1:{port}", timeout_s=5, attempts=1,
                                               security=ClientSecurity(token=token))
                        for name, token in self.tokens.items()}

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.server.stop(grace=0)
        self.book.stop()


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def service(spool: Path) -> Iterator[Service]:
    svc = Service(spool)
    yield svc
    svc.close()


def test_installing_the_same_settings_again_is_taken_and_other_settings_are_refused(service: Service) -> None:
    coordinator = service.clients["coordinator"]
    settings = sections_settings("j", aggregation=ROBUST)
    assert coordinator.install_job(settings) == settings_digest(settings)
    assert coordinator.install_job(settings) == settings_digest(settings)  # a retry, or a restarted coordinator
    with pytest.raises(RemoteError) as info:
        coordinator.install_job(sections_settings("j", aggregation={"robust": "median"}))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "installed with other settings" in str(info.value)
    assert service.book.installed.get("j").settings.robust.params.beta == 0.2  # the first settings stand


def test_bad_settings_are_refused_naming_the_field_and_nothing_is_installed(service: Service) -> None:
    bad = sections_settings("j", aggregation={"robust": "trimmed_mean", "robust_params": {"beta": 0.7}})
    with pytest.raises(RemoteError) as info:
        service.clients["coordinator"].install_job(bad)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "aggregation.robust_params.beta" in str(info.value)
    good = sections_settings("j", aggregation=ROBUST)
    assert service.clients["coordinator"].install_job(good) == settings_digest(good)


def test_only_the_coordinator_installs_a_job(service: Service) -> None:
    with pytest.raises(RemoteError) as info:
        service.clients["w1"].install_job(sections_settings("j", aggregation=ROBUST))
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(KeyError):
        service.book.installed._jobs["j"]


def test_installed_settings_survive_a_restart_so_rounds_open_without_a_resend(spool: Path) -> None:
    first = Service(spool)
    settings = sections_settings("j", aggregation=ROBUST)
    first.clients["coordinator"].install_job(settings)
    first.clients["coordinator"].put_global("j", 1, SPEC.to_json(), weights(0.0))
    first.close()
    restarted = Service(spool)
    try:
        assert restarted.clients["coordinator"].open_round("j", 1, ["w1", "w2"], 4e9, seed=0) == 1
        assert restarted.book.table.jobs["j"].round.algorithms.settings.robust.name == "trimmed_mean"
        assert restarted.book.installed.get("j").installed.digest == settings_digest(settings)
    finally:
        restarted.close()


def test_a_participant_that_lost_the_settings_fetches_them_and_no_other_worker_can(service: Service) -> None:
    coordinator = service.clients["coordinator"]
    settings = sections_settings("j", aggregation=ROBUST)
    digest = coordinator.install_job(settings)
    coordinator.put_global("j", 1, SPEC.to_json(), weights(0.0))
    coordinator.open_round("j", 1, ["w1"], 4e9, seed=0)
    assert service.clients["w1"].job_settings("j", "w1", digest) == settings
    with pytest.raises(RemoteError) as info:  # w2 is not a participant of the job
        service.clients["w2"].job_settings("j", "w2", digest)
    assert "not a participant of job" in str(info.value)
    with pytest.raises(RemoteError) as info:  # nor may it ask under w1's id
        service.clients["w2"].job_settings("j", "w1", digest)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
