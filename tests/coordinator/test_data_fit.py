"""The coordinator knows what its workers' data looks like (registration: one sample's shape, the classes)
and refuses over gRPC, at submission, a job whose model cannot take it; a state file from before these
fields opens and keeps working."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import REGISTRY

from fedbroker.bus import InProcessBus
from fedbroker.config import DPPolicy
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import CoordinatorClient, serve
from fedbroker.coordinator.store import StateStore
from fedbroker.rpc.aggregation_client import AggregatorClient

pytestmark = pytest.mark.timeout(60)

JOB = {
    "name": "fit", "category": "clinic", "seed": 0,
    "model": {"input_shape": [3], "layers": [{"type": "Linear", "in_features": 3, "out_features": 4}]},
    "training": {"rounds": 1},
}


def register(store: StateStore, worker_id: str, shape: list[int], classes: int, category: str = "clinic") -> None:
    store.upsert_worker(worker_id=worker_id, categories=[category], histogram=[1] * classes,
                        dp=DPPolicy(enabled=False), epsilon_spent=0.0, device="cpu", num_samples=10, input_shape=shape,
                        num_classes=classes)


def rejected() -> float:
    return REGISTRY.get_sample_value("fedbroker_coordinator_jobs_rejected_total", {"reason": "invalid_config"}) or 0.0


def test_a_job_that_does_not_fit_the_registered_data_is_refused_over_grpc_naming_the_field(tmp_path: Path) -> None:
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    coordinator = Coordinator(bus=InProcessBus(namespace="fit-test"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"))
    register(store, "site-a", [5], 4)
    register(store, "site-b", [3], 6)
    register(store, "elsewhere", [99], 99, category="other")  # another category's data is not this job's concern
    server, port = serve(coordinator)
    client = CoordinatorClient(f"127.0.0.1:{port}")
    before = rejected()
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.submit(yaml.safe_dump(JOB))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert "model.input_shape: is [3] but the samples of worker site-a (category 'clinic') have shape [5]" in details
        assert ("model.layers[0].out_features: the model outputs 4 class scores but the data of worker site-b "
                "(category 'clinic') has 6 classes") in details
        assert "elsewhere" not in details
        assert rejected() == before + 1
        assert store.jobs() == []
        register(store, "site-a", [3], 4)  # site-a re-registers with data the model takes
        store.upsert_worker(worker_id="site-b", categories=["other"], histogram=[], dp=DPPolicy(enabled=False),
                            epsilon_spent=0.0, device="cpu", num_samples=1)
        assert client.submit(yaml.safe_dump(JOB)).startswith("fit-")
    finally:
        client.close()
        server.stop(grace=0)
        coordinator.stop()
        store.close()


def test_a_state_file_from_before_the_data_fields_gains_them_and_old_workers_are_not_judged(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE workers (worker_id TEXT PRIMARY KEY, categories_json TEXT NOT NULL, histogram_json TEXT "
               "NOT NULL, dp_enabled INTEGER NOT NULL, dp_json TEXT NOT NULL, epsilon_spent REAL NOT NULL, device TEXT "
               "NOT NULL, num_samples INTEGER NOT NULL, registered REAL NOT NULL, last_seen REAL NOT NULL, state TEXT "
               "NOT NULL DEFAULT 'idle')")
    db.execute("INSERT INTO workers VALUES ('old', '[\"clinic\"]', '[1, 2]', 0, '{}', 0.5, 'cpu', 3, 1.0, 1.0, 'idle')")
    db.commit()
    db.close()
    store = StateStore(str(path))
    try:
        (old,) = store.workers()
        assert old.worker_id == "old" and old.input_shape == () and old.num_classes == 0
        register(store, "new", [1, 8, 8], 10)
        new = next(w for w in store.workers() if w.worker_id == "new")
        assert new.input_shape == (1, 8, 8) and new.num_classes == 10
    finally:
        store.close()
