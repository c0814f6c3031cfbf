"""DWFed weighting with genetic base-model selection, end to end over the real RabbitMQ and gRPC on loopback.

What only a real federation shows: the coordinator sends the population distribution P with each round
task, the workers compute and report their ISH, the aggregation service weights by it, and the GA runs
in exactly the GA rounds on the updates that really arrived.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

import fedbroker.aggregators.metrics  # noqa: F401  (registers the service's metrics before any round)
from fedbroker.app.round_notes import event_words
from fedbroker.job.spec import parse_job
from fedbroker.proto import fedbroker_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKERS = 4
M = 2
GA_GAP = 2
ROUNDS = 2 * GA_GAP  # GA in rounds 2 and 4, random selection in rounds 1 and 3
ISH_K = M  # K in eq. 12 (docs/algorithms.md, `dwfed`): the number of updates aggregated this round, m under ga or random

JOB: dict[str, Any] = {
    "name": "dwfed-ga",
    "category": "digits",
    "seed": 3,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": ROUNDS, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "aggregation": {
        "weighting": "dwfed", "weighting_params": {"ish_form": "ratio"},
        "selection": "ga", "selection_params": {"m": M, "ga_gap": GA_GAP, "population": 20, "generations": 5,
                                                "probe_dataset": "digits", "probe_size": 128},
    },
    "schedule": {"min_workers": WORKERS, "wait_for_workers_s": 30, "round_timeout_s": 1200},  # far beyond the test's timeout
    "evaluation": {"dataset": "digits"},
}


def _record_close_replies(federation) -> list[pb.CloseRoundReply]:
    """Keep every CloseRound reply the coordinator receives over gRPC (the per-update weights live only there)."""
    client = federation.coordinator.aggregator
    original: Callable[..., pb.CloseRoundReply] = client.close_round
    replies: list[pb.CloseRoundReply] = []

    def spy(*args: Any, **kwargs: Any) -> pb.CloseRoundReply:
        reply = original(*args, **kwargs)
        replies.append(reply)
        return reply

    client.close_round = spy
    return replies


def _metric(name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the aggregation service's metrics (same process, default registry); 0 before first use."""
    return float(REGISTRY.get_sample_value(name, labels or {}) or 0.0)


GA_RUNS = ("fedbroker_aggregator_selection_ga_runs_total", {"selection": "ga"})
ROUNDS_CLOSED = ("fedbroker_aggregator_rounds_closed_total", {"alignment": "none", "weighting": "dwfed", "selection": "ga"})
AGGREGATED = ("fedbroker_aggregator_updates_aggregated_total", {})
FALLBACKS = ("fedbroker_aggregator_selection_fallbacks_total", {"selection": "ga"})
FITNESS = ("fedbroker_aggregator_selection_fitness", {"selection": "ga"})


def test_dwfed_with_ga_selection_runs_ga_every_gap_and_weights_by_reported_ish(federation):
    before = {name: _metric(*metric) for name, metric in
              {"rounds": ROUNDS_CLOSED, "aggregated": AGGREGATED, "fallbacks": FALLBACKS, "ga_runs": GA_RUNS}.items()}
    replies = _record_close_replies(federation)
    for i in range(WORKERS):
        federation.add_worker(f"w{i}", index=i, count=WORKERS, scheme="dirichlet", alpha=0.3)
    # what the coordinator receives and each ISH is computed from: the released (noised, drawn once) histograms
    histograms = {w: agent.sharing.histogram()[0] for w, agent in federation.workers.items()}
    population = np.sum(list(histograms.values()), axis=0) / sum(int(h.sum()) for h in histograms.values())
    distances = {w: float(np.abs(h / h.sum() - population).sum()) for w, h in histograms.items()}
    assert max(distances.values()) - min(distances.values()) > 0.05, distances  # the split really is non-IID

    job_id = federation.coordinator.submit(parse_job(copy.deepcopy(JOB)))
    status = federation.coordinator.wait(job_id, timeout=100)
    assert status == "completed", federation.store.job(job_id).error

    rounds = federation.store.rounds(job_id)
    assert [r.round for r in rounds] == list(range(1, ROUNDS + 1))
    assert [reply.model_version for reply in replies] == list(range(2, ROUNDS + 2))
    for r in rounds:
        stats = r.stats
        ga_round = r.round % GA_GAP == 0
        assert r.status == "closed" and r.uploaded == WORKERS, r
        assert r.aggregated == M and stats["aggregated"] == M and stats["accepted"] == WORKERS, stats
        assert stats["selection_ga_ran"] == stats["selection_ga_round"] == float(ga_round), (r.round, stats)
        assert stats["selection_fallback"] == 0.0 and stats["weighting_fallback"] == 0.0, stats
        if ga_round:  # the GA's own numbers reach the store; random rounds have none
            assert stats["selection_seconds"] > 0 and stats["selection_generations"] == 5, stats
            assert np.isfinite(stats["selection_fitness"]) and -1.0 <= stats["selection_loss1"] <= 1.0, stats
        else:
            assert "selection_fitness" not in stats, stats
        chosen = [p.worker_id for p in federation.store.participants(job_id, r.round) if p.status == "aggregated"]
        assert chosen == sorted(replies[r.round - 1].aggregated) and len(chosen) == M
        # `jobs logs` says, round by round, whether the GA or a random draw chose
        (note,) = [event_words(e.kind, e.round, e.message) for e in federation.store.events(job_id)
                       if e.kind == "selection" and e.round == r.round]
        assert note == (f"the genetic algorithm chose {M} of {WORKERS} update(s) (fitness {stats['selection_fitness']:.4g})"
                        if ga_round else f"{M} of {WORKERS} update(s) chosen at random: round {r.round} is not a GA "
                                         f"round (the GA runs every ga_gap-th round)"), note

    # Every reported ISH reached the service: each chosen update's coefficient is its ISH normalised over
    # the chosen ones.
    unequal = 0
    for number, reply in enumerate(replies, start=1):
        weights = {u.worker_id: u.weight for u in reply.updates}
        assert sorted(reply.aggregated) == sorted(w for w, a in weights.items() if a > 0), number
        ish = {w: (1 - distances[w] / ISH_K) / (1 + distances[w]) for w in reply.aggregated}
        expected = {w: v / sum(ish.values()) for w, v in ish.items()}
        for w in reply.aggregated:
            assert weights[w] == pytest.approx(expected[w], rel=1e-6), (number, weights, expected)
        assert sum(weights.values()) == pytest.approx(1.0, abs=1e-9)
        unequal += abs(weights[reply.aggregated[0]] - weights[reply.aggregated[1]]) > 1e-3
    assert unequal >= 1, [dict((u.worker_id, u.weight) for u in r.updates) for r in replies]

    # The service's metrics moved with it: rounds closed under these algorithms, updates aggregated (m per
    # round), no GA fallback, and the fitness gauge holds the last GA round's fitness.
    assert _metric(*ROUNDS_CLOSED) - before["rounds"] == ROUNDS
    assert _metric(*AGGREGATED) - before["aggregated"] == ROUNDS * M
    assert _metric(*FALLBACKS) - before["fallbacks"] == 0
    assert _metric(*GA_RUNS) - before["ga_runs"] == ROUNDS // GA_GAP
    last_ga = rounds[-1].stats
    assert _metric(*FITNESS) == pytest.approx(last_ga["selection_fitness"], rel=1e-12)
