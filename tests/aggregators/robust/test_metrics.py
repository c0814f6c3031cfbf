"""The aggregation service counts, per rule and site, each update a robust rule judged and its verdict; the
series exist at 0 from the round's opening, so the first discard is an increase the alert can see."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY

from fedbroker.aggregators import metrics as agg_metrics
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.close_report import Verdict
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.installed import install
from tests.ops.test_metrics import SPEC, weights

AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all", "robust": "multi_krum",
       "robust_params": {"f": 1}}


def count(verdict: str, worker: str, rule: str = "multi_krum") -> float | None:
    return REGISTRY.get_sample_value(f"fedbroker_aggregator_robust_updates_{verdict}_total",
                                     {"robust": rule, "worker_id": worker})


@pytest.mark.integration
def test_a_close_counts_each_site_s_verdict_from_series_that_start_at_zero() -> None:
    server, port = serve(RoundBook())
    client = AggregatorClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        job, sites = f"r-{uuid.uuid4().hex[:6]}", [f"site-{uuid.uuid4().hex[:6]}" for _ in range(5)]
        client.put_global(job, 1, SPEC.to_json(), weights(0.0))
        install(client, job, AGG)
        client.open_round(job, 1, sites, deadline_unix=4e9, seed=0)
        assert [count(v, sites[0]) for v in ("judged", "discarded", "downweighted")] == [0.0, 0.0, 0.0]
        for i, site in enumerate(sites):
            value = -500.0 if i == 0 else 1.0 + 0.01 * i
            client.upload(job_id=job, round=1, worker_id=site, num_samples=5, tensors=weights(value))
        client.close_round(job, 1)
    finally:
        client.close()
        server.stop(grace=0)
    assert all(count("judged", s) == 1.0 for s in sites)
    assert count("discarded", sites[0]) == 1.0
    assert sum(count("discarded", s) or 0.0 for s in sites[1:]) <= 1.0  # Multi-Krum averages n − f = 4 of 5


def test_verdicts_are_counted_by_their_thresholds() -> None:
    rule = "trimmed_mean"
    agg_metrics.robust_round_opened(rule, ["x-kept", "x-half", "x-gone"])
    agg_metrics.record_robust([Verdict("x-kept", rule, 0.9, 1.0), Verdict("x-half", rule, 0.3, 1.0),
                               Verdict("x-gone", rule, 0.0, 1.0)])
    assert [count("judged", w, rule) for w in ("x-kept", "x-half", "x-gone")] == [1.0, 1.0, 1.0]
    assert [count("discarded", w, rule) for w in ("x-kept", "x-half", "x-gone")] == [0.0, 0.0, 1.0]
    assert [count("downweighted", w, rule) for w in ("x-kept", "x-half", "x-gone")] == [0.0, 1.0, 0.0]
    agg_metrics.robust_round_opened("none", ["y"])
    agg_metrics.record_robust([])  # a job without a rule judges nobody
    assert count("judged", "y", "none") is None  # a job without a rule makes no series

