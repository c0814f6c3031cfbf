"""Start weights through the coordinator's real gRPC service, one identity per participant: a file that does not
match its pin, weights that do not fit the model, a forged `from_job` (another submitter's job, an unknown id,
a job still running) are refused before the job is recorded, each naming the field; an honest pin and a
completed job of one's own (its LoRA adapters merged) start the job."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedbroker.bus import InProcessBus
from fedbroker.coordinator.checkpoints import save_checkpoint
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import CoordinatorClient, serve
from fedbroker.coordinator.start_weights import load_start
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import parse_job, parse_model
from fedbroker.job.status import JobStatus
from fedbroker.model import initial_weights
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.weights.adapters import start_state
from fedbroker.weights.plan import merge_adapters
from fedbroker.weights.start import encode, sha256_hex
from tests.security.conftest import token_table

MODEL = {"input_shape": [4], "layers": [
    {"type": "Linear", "in_features": 4, "out_features": 5}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 5, "out_features": 3}]}
SPEC = parse_model(MODEL)
IDENTITIES = {"alice": "submitter", "bob": "submitter"}


@dataclass
class Served:
    store: StateStore
    port: int
    tokens: dict[str, str]
    checkpoints: Path

    def client(self, identity: str) -> CoordinatorClient:
        return CoordinatorClient(f"127.0.0.1:{self.port}", security=ClientSecurity(token=self.tokens[identity]),
                                 timeout_s=10)


def job_text(**model: object) -> str:
    return json.dumps({"name": "ft", "category": "c", "model": {**MODEL, **model},
                       "schedule": {"wait_for_workers_s": 0}})


def finished_job(store: StateStore, folder: Path, job_id: str, submitter: str, status: JobStatus) -> dict:
    """A recorded job of `submitter` with LoRA adapters whose last round left a checkpoint; its final weights."""
    spec = parse_job(json.loads(job_text(adapters={"rank": 2, "alpha": 4, "targets": ["0"], "train": ["2"]})))
    state = start_state(spec.model, spec.plan, seed=1)
    state["0.lora_b.weight"] = np.full_like(state["0.lora_b.weight"], 0.5)
    store.add_job(job_id, "ft", spec.to_json(), 1, spec.model.to_json(), submitter=submitter)
    store.open_round(job_id, 1, ["w"])
    checkpoint = save_checkpoint(folder, job_id, 1, state, spec.model.to_json())
    store.close_round(job_id, 1, model_version=2, aggregated=["w"], updates=[("w", 10, 1.0, 0.1)], accuracy=None,
                      loss=None, seconds=1.0, checkpoint=checkpoint, stats={}, model_spec_json=spec.model.to_json())
    store.set_job_status(job_id, status)
    assert spec.plan.adapters is not None
    return merge_adapters(state, spec.plan.adapters)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    coordinator = Coordinator(bus=InProcessBus(namespace="start-weights"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"))
    table, tokens = token_table(IDENTITIES)
    server, port = serve(coordinator, tokens=table)
    try:
        yield Served(store, port, tokens, tmp_path / "ck")
    finally:
        server.stop(grace=0)
        coordinator.stop()
        store.close()


def refused(served: Served, identity: str, text: str, *fragments: str, weights: bytes = b"") -> None:
    before = len(served.store.jobs())
    with pytest.raises(grpc.RpcError) as info, served.client(identity) as client:
        client.submit_job(text, initial_weights=weights)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details(), info.value.details()
    assert len(served.store.jobs()) == before   # nothing recorded, nothing started


def test_weights_that_do_not_match_their_pin_are_refused_naming_both_digests(served: Served) -> None:
    data = encode(initial_weights(SPEC, seed=2))
    forged = encode(initial_weights(SPEC, seed=3))
    text = job_text(initial_weights={"path": "w.safetensors", "sha256": sha256_hex(data)})
    refused(served, "alice", text, "model.initial_weights.sha256", sha256_hex(forged), sha256_hex(data),
            weights=forged)
    refused(served, "alice", text, "carries no weights")


def test_pinned_weights_that_do_not_fit_the_model_are_refused_naming_the_node(served: Served) -> None:
    tensors = initial_weights(SPEC, seed=2)
    tensors["2.weight"] = np.zeros((3, 4), np.float32)
    data = encode(tensors)
    refused(served, "alice", job_text(initial_weights={"path": "w.safetensors", "sha256": sha256_hex(data)}),
            "model.initial_weights.2.weight", "node '2' needs [3, 5]", weights=data)


def test_honest_pinned_weights_start_the_job_as_they_are(served: Served) -> None:
    tensors = initial_weights(SPEC, seed=2)
    data = encode(tensors)
    with served.client("alice") as client:
        job_id = client.submit_job(job_text(initial_weights={"path": "w.safetensors", "sha256": sha256_hex(data)}),
                                   initial_weights=data).job_id
    kept = load_start(served.checkpoints, job_id)
    assert all(np.array_equal(kept[name], tensors[name]) for name in tensors) and set(kept) == set(tensors)


def test_a_forged_from_job_gets_the_same_refusal_as_an_unknown_id(served: Served) -> None:
    finished_job(served.store, served.checkpoints, "bobs-1", "bob", JobStatus.COMPLETED)
    refused(served, "alice", job_text(from_job="bobs-1"), "model.from_job", "no job 'bobs-1' that alice may read")
    refused(served, "alice", job_text(from_job="nobody-9"), "model.from_job", "no job 'nobody-9' that alice may read")


def test_a_job_that_did_not_finish_cannot_start_another(served: Served) -> None:
    finished_job(served.store, served.checkpoints, "alices-1", "alice", JobStatus.FAILED)
    refused(served, "alice", job_text(from_job="alices-1"), "job 'alices-1' is failed", "completed")


def test_a_completed_job_of_ones_own_starts_the_next_with_its_adapters_merged(served: Served) -> None:
    merged = finished_job(served.store, served.checkpoints, "alices-2", "alice", JobStatus.COMPLETED)
    with served.client("alice") as client:
        job_id = client.submit_job(job_text(from_job="alices-2", freeze=["0"])).job_id
    kept = load_start(served.checkpoints, job_id)
    assert set(kept) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    np.testing.assert_array_equal(kept["0.weight"], merged["0.weight"])
