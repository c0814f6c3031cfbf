"""A GA round with `fitness: probe` through the real aggregation service on loopback gRPC: the service loads
the job's probe set, the GA scores candidate aggregates on it, and the round's model is the chosen aggregate."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from fedbroker.aggregators.probe_sets import probe_arrays
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.datasets import load_dataset, train_test_split
from fedbroker.job.spec import parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.installed import install

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPEC = parse_model({"input_shape": [1, 8, 8], "layers": [
    {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 16}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 16, "out_features": 10}]})
AGGREGATION = {"selection": "ga", "selection_params": {
    "m": 2, "ga_gap": 1, "mu": 10.0, "population": 20, "generations": 5, "probe_dataset": "digits", "probe_size": 200}}


def state_of(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}


def trained(part: int) -> dict[str, np.ndarray]:
    """The global model trained on one half of the digits training split (what the workers hold), never
    on the held-out part the probe set comes from."""
    train, _ = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)
    model = build_model(SPEC, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    x, y = torch.from_numpy(train.x[part::2]), torch.from_numpy(train.y[part::2])
    for _ in range(100):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return state_of(model)


def probe_loss(state: dict[str, np.ndarray]) -> float:
    x, y = probe_arrays("digits", 200, 0)
    model = build_model(SPEC).eval()
    load_numpy_state(model, state)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(torch.from_numpy(np.array(x))), torch.from_numpy(np.array(y))))


def test_ga_with_a_probe_set_chooses_the_updates_whose_aggregate_classifies_the_probe_set_best():
    server, port = serve(RoundBook())
    try:
        with AggregatorClient(f"127.0.0.1:{port}") as client:
            client.put_global("j", 1, SPEC.to_json(), state_of(build_model(SPEC, seed=0)))
            workers = ["bad0", "good0", "bad1", "good1", "bad2"]
            install(client, "j", AGGREGATION)
            client.open_round("j", 1, workers, time.time() + 60, seed=0)
            for k, w in enumerate(workers):
                state = trained(int(w[-1])) if w.startswith("good") else state_of(build_model(SPEC, seed=100 + k))
                client.upload(job_id="j", round=1, worker_id=w, num_samples=100, tensors=state)
            reply = client.close_round("j", 1)
            stats = dict(reply.stats)
            _, spec_json, merged = client.download("j", 2)
    finally:
        server.stop(grace=0)
    assert sorted(reply.aggregated) == ["good0", "good1"]
    assert stats["selection_ga_ran"] == 1.0 and stats["selection_fallback"] == 0.0, stats
    assert stats["selection_seconds"] > 0 and -1.0 <= stats["selection_loss1"] <= 1.0, stats
    # Loss2 is the probe cross-entropy of exactly the model the round built from the chosen updates
    assert json.loads(spec_json) == SPEC.to_dict()
    assert stats["selection_loss2"] == pytest.approx(probe_loss(merged), rel=1e-4)
    assert stats["selection_fitness"] == pytest.approx(stats["selection_loss1"] + 10.0 * stats["selection_loss2"])


def test_a_ga_job_whose_probe_set_the_model_cannot_read_is_refused_at_submission():
    from fedbroker.errors import ConfigError
    from fedbroker.job.submission import accept_job

    job = {"name": "g", "category": "iris", "model": SPEC.to_dict(), "training": {"rounds": 1},
           "aggregation": {"selection": "ga", "selection_params": {"m": 2, "probe_dataset": "iris"}}}
    with pytest.raises(ConfigError, match=r"aggregation\.selection_params\.probe_dataset.*shape"):
        accept_job(job)


def test_the_service_reads_the_probe_set_the_job_names_from_its_loader():
    """RoundBook(probe_sets=...) is where a deployment plugs in its own public or synthetic probe data."""
    asked: list[tuple[str, int, int]] = []
    rng = np.random.default_rng(0)

    def loader(dataset: str, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        asked.append((dataset, size, seed))
        return rng.normal(size=(size, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, size=size)

    from fedbroker.proto import fedbroker_pb2 as pb
    from fedbroker.rpc import codec

    book = RoundBook(probe_sets=loader)
    book.put_global("j", 1, SPEC.to_json(), state_of(build_model(SPEC, seed=0)))
    params = dict(AGGREGATION["selection_params"], probe_size=17, probe_seed=5)
    workers = ["a", "b", "c"]
    book.open_round("j", 1, workers, deadline=1e12, aggregation={"selection": "ga", "selection_params": params})
    for k, w in enumerate(workers):
        state = state_of(build_model(SPEC, seed=10 + k))
        header = pb.UpdateHeader(job_id="j", round=1, worker_id=w, num_samples=10, tensors=codec.tensor_specs(state))
        book.receive_update(codec.stream_messages(pb.UpdateChunk, header, state))
    result = book.close("j", 1)
    assert asked == [("digits", 17, 5)]
    assert result.stats["selection_ga_ran"] == 1.0 and len(result.aggregated) == 2
