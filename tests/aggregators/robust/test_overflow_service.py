"""The aggregation service as deployed (`fedbroker aggregator`, over gRPC): a finite upload of 3e38 is refused at
the door (`out_of_range`, naming the bound) under FLTrust and plain FedAvg, and the honest uploads of the
round still close to a finite global model; a job's declared bound lets a larger value in, and the model
stays finite. On main the same upload was taken and the round's model was NaN (FLTrust) or infinite (FedAvg)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from fedbroker.errors import Rejection
from fedbroker.job.spec import parse_model
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.plumbing import RemoteError
from tests.faults.harness import wait_for
from tests.installed import install
from tests.integration.processes import Deployment, stop_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DIGITS = parse_model({"input_shape": [1, 8, 8], "layers": [
    {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}]})
HONEST = ("site-a", "site-b", "site-c")
FLTRUST = {"robust": "fltrust", "robust_params": {"probe_dataset": "digits", "probe_size": 32}}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AggregatorClient]:
    deployment = Deployment("amqp://unused", tmp_path_factory.mktemp("agg"), name="overflow", worker_ids=[])
    deployment.spawn("aggregator", "aggregator", {"aggregator.listen": deployment.aggregator})
    try:
        def ready() -> bool:
            deployment.alive("aggregator")
            with grpc.insecure_channel(deployment.aggregator) as channel:
                try:
                    grpc.channel_ready_future(channel).result(timeout=1)
                except grpc.FutureTimeoutError:
                    return False
            return True

        wait_for(ready, 90, "the aggregation service to serve")
        with AggregatorClient(deployment.aggregator) as client:
            yield client
    finally:
        stop_all(list(deployment.processes.values()))


def start() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"1.weight": (0.1 * rng.normal(size=(10, 64))).astype(np.float32), "1.bias": np.zeros(10, np.float32)}


def round_of(client: AggregatorClient, job: str, aggregation: dict[str, Any], evil: float) -> tuple[str, Any]:
    """One round: three honest sites near the global model and one whose every value is `evil` (times the
    global model's sign); the evil upload's refusal reason ('' if taken) and the close's reply."""
    base = start()
    install(client, job, {"alignment": "none", "weighting": "fedavg", "selection": "all", **aggregation})
    client.put_global(job, 1, DIGITS.to_json(), base)
    client.open_round(job, 1, [*HONEST, "evil"], time.time() + 600, seed=0)
    rng = np.random.default_rng(5)
    for i, site in enumerate(HONEST):
        honest = {k: (v + 0.01 * rng.normal(size=v.shape)).astype(np.float32) for k, v in base.items()}
        client.upload(job_id=job, round=1, worker_id=site, num_samples=50 + i, tensors=honest)
    poison = {k: (np.where(v >= 0, 1.0, -1.0) * evil).astype(np.float32) for k, v in base.items()}
    try:
        client.upload(job_id=job, round=1, worker_id="evil", num_samples=50, tensors=poison)
        refused = ""
    except RemoteError as exc:
        refused = f"{exc.reason}: {exc}"
    return refused, client.close_round(job, 1)


@pytest.mark.parametrize("aggregation", [FLTRUST, {}], ids=["fltrust", "fedavg"])
def test_a_3e38_upload_is_refused_at_the_door_and_the_honest_ones_close_to_a_finite_model(
        service: AggregatorClient, aggregation: dict[str, Any]) -> None:
    job = f"overflow-{aggregation.get('robust', 'fedavg')}"
    refused, reply = round_of(service, job, aggregation, 3e38)
    assert refused.startswith(Rejection.OUT_OF_RANGE), refused
    assert "beyond the job's bound" in refused and "aggregation.max_update_value" in refused
    assert reply.model_version == 2 and "evil" not in reply.aggregated
    if not aggregation:  # FedAvg takes every honest update (FLTrust those its g_0 trusts: noise here)
        assert sorted(reply.aggregated) == sorted(HONEST)
    version, _, tensors = service.download(job, 2)
    assert version == 2 and all(np.all(np.isfinite(t)) for t in tensors.values())
    assert max(float(np.max(np.abs(t))) for t in tensors.values()) < 1.0  # the honest sites' model


def test_a_declared_bound_lets_a_larger_value_in_and_the_model_stays_finite(service: AggregatorClient) -> None:
    refused, reply = round_of(service, "overflow-declared", {**FLTRUST, "max_update_value": 1e20}, 1e20)
    assert refused == ""  # within the job's declared range: taken, and FLTrust weighs it
    _, _, tensors = service.download("overflow-declared", reply.model_version)
    assert all(np.all(np.isfinite(t)) for t in tensors.values())
