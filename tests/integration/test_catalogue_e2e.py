"""The catalogue's two cheapest models, the LSTM classifier and the text Transformer, at their catalogue size
through real processes: the aggregation service, the coordinator and two sites per model, each its own process
over RabbitMQ, DP on at every site, on token ids from the sites' own .npz files; each download's README snippet,
run in a fresh interpreter, gives the served model's outputs. `make experiment-catalogue` runs all four models
(ResNet-18 and the U-Net too) the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from experiments.catalogue_e2e import SETTINGS, job_for, served_outputs, snippet_outputs
from tests.integration.processes import Deployment
from tests.integration.test_consortium_study import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODELS = ("lstm_classifier", "text_transformer")
SITES = ("north", "south")


@pytest.fixture
def deployment(rabbitmq_url: str, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(rabbitmq_url, tmp_path, name="catalogue", worker_ids=[f"{m}-{s}" for m in MODELS for s in SITES])
    try:
        yield d
    finally:
        d.close()


def test_the_catalogue_lstm_and_transformer_train_under_dp_and_their_downloads_load(deployment: Deployment) -> None:
    d = deployment
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": d.tmp / "spool"})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": d.tmp / "state"})
    for model in MODELS:
        setting = SETTINGS[model]
        for i, site in enumerate(SITES):
            x, y = setting.make(np.random.default_rng(10 + i), 96)
            np.savez(d.tmp / f"{model}-{site}.npz", x=x, y=y)
            d.spawn(f"{model}-{site}", "worker", {
                "worker.id": f"{model}-{site}", "worker.categories": f"catalogue-{model}", "worker.dataset": "npz",
                "worker.data.path": str(d.tmp / f"{model}-{site}.npz"), "worker.data.num_classes": 2,
                "worker.ledger_path": str(d.tmp / f"{model}-{site}-ledger.json"), "worker.device": "cpu",
                "worker.heartbeat_s": 0.5, "worker.torch_threads": 1, "worker.dp.noise_multiplier": 1.0,
                "worker.dp.max_grad_norm": 1.0, "worker.dp.epsilon_budget": 50})

    wait_for(lambda: d.listed(len(MODELS) * len(SITES)), 240, "the four sites to register", d)
    ids = {}
    for model in MODELS:
        job = job_for(SETTINGS[model], sites=len(SITES))
        job["training"]["rounds"] = 1
        path = d.tmp / f"{model}.json"
        path.write_text(json.dumps(job))
        submitted = json.loads(d.cli("submit", str(path), "--json"))
        assert submitted["model_bounds"]["parameters"] == {"lstm_classifier": 295_682,
                                                           "text_transformer": 203_138}[model]
        ids[model] = submitted["job_id"]

    for model, job_id in ids.items():
        doc = wait_for(lambda job_id=job_id: d.ended_job(job_id), 480, f"the {model} job to end", d)
        assert doc["status"] == "completed", doc.get("error")
        sent = [p for p in doc["participants"] if p["status"] == "aggregated"]
        assert len(sent) == len(SITES) and all(p["epsilon"] > 0 for p in sent)  # DP at every site
        out = d.tmp / f"{model}-download"
        d.cli("jobs", "download", job_id, "--out", str(out))
        x = np.load(d.tmp / f"{model}-north.npz")["x"][:4]
        got, served = snippet_outputs(out, x), served_outputs(d.tmp / "state", job_id, x)
        assert got.shape == served.shape == (4, 2)
        np.testing.assert_allclose(got, served, rtol=1e-5, atol=1e-5)
