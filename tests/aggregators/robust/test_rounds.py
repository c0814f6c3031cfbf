"""A round whose job names a robust rule closes with the rule's result: one poisoned update does not move the
global model, the close's stats name who was discarded, and the coordinator records it on the participant."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.root_update import train_root_update
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.app.round_notes import robust_note, selection_note
from fedbroker.close_report import judged
from fedbroker.coordinator.store import StateStore
from tests.aggregators.test_rounds import SPEC, stream

HONEST = {"w1": 1.0, "w2": 1.2, "w3": 0.8, "w4": 1.1}
RULES: dict[str, dict[str, Any]] = {
    "median": {}, "trimmed_mean": {"beta": 0.2}, "multi_krum": {"f": 1}, "geometric_median": {},
    "norm_bound": {"max_norm": 5.0}, "fltrust": {"probe_dataset": "digits", "probe_size": 16, "lr": 0.1},
}


def weights(value: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(int(value * 1000) % 2**32)  # a little spread, so no two updates are equal
    return {"0.weight": (value + 0.01 * rng.normal(size=(3, 4))).astype(np.float32),
            "0.bias": np.full(3, value, np.float32), "2.weight": np.full((2, 3), value, np.float32),
            "2.bias": np.full(2, value, np.float32)}


def probe(_name: str, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A root set of the test model's shape (the service's probe set stands in for it)."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(size, 4)).astype(np.float32), rng.integers(0, 2, size=size)


def global_model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: (0.5 * rng.normal(size=v.shape)).astype(np.float32) for k, v in weights(0.0).items()}


def close_with(rule: str, poison: float, updates: dict[str, dict[str, np.ndarray]] | None = None,
               ) -> tuple[Any, dict[str, np.ndarray]]:
    book = RoundBook(max_update_bytes=10_000, probe_sets=probe)
    start = global_model() if updates else {k: np.zeros_like(v) for k, v in weights(0.0).items()}
    book.put_global("j", 1, SPEC.to_json(), start)
    aggregation = {"alignment": "none", "weighting": "fedavg", "selection": "all", "robust": rule,
                   "robust_params": RULES.get(rule, {})}
    book.open_round("j", 1, [*HONEST, "evil"], deadline=math.inf, aggregation=aggregation, seed=0)
    sent = updates or {**{w: weights(v) for w, v in HONEST.items()}, "evil": weights(poison)}
    for worker, tensors in sent.items():
        book.receive_update(stream(tensors, worker=worker, n=10))
    result = book.close("j", 1)
    return result, book.global_model("j")[2]


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "multi_krum", "geometric_median", "norm_bound"])
def test_one_poisoned_update_does_not_move_the_global_model(rule: str) -> None:
    result, state = close_with(rule, poison=-1000.0)
    assert "evil" not in result.aggregated and set(result.aggregated) <= set(HONEST)
    assert {v.worker_id: v.judgement for v in result.verdicts}["evil"] == "discarded"
    assert {v.rule for v in result.verdicts} == {rule} and len(result.verdicts) == len(HONEST) + 1
    assert result.stats["robust_discarded"] >= 1 and f"{rule} discarded evil" in robust_note(result.verdicts)
    low, high = (0.0, 5.0 / np.sqrt(31)) if rule == "norm_bound" else (0.8, 1.2)
    assert low - 1e-3 <= float(state["0.bias"][0]) <= high + 1e-3   # the honest range (norm_bound: M/‖Δ‖ of it)
    assert {u.worker_id: u.weight for u in result.updates}["evil"] == 0.0
    _, plain = close_with("none", poison=-1000.0)
    assert float(plain["0.bias"][0]) < -100  # without the rule the same round is wrecked


def test_fltrust_trains_its_root_update_and_distrusts_an_update_against_it() -> None:
    start = global_model()
    x, y = probe("digits", 16, 0)
    g0 = train_root_update(SPEC, start, x, y, epochs=1, lr=0.1, batch_size=32, seed=0)  # one full batch: any seed
    rng = np.random.default_rng(1)
    honest = {w: {k: start[k] + scale * g0[k] + 0.001 * rng.normal(size=g0[k].shape).astype(np.float32)
                  for k in start} for w, scale in HONEST.items()}
    evil = {k: start[k] - 50.0 * g0[k] for k in start}          # a scaled sign flip of the honest direction
    result, state = close_with("fltrust", 0.0, updates={**honest, "evil": evil})
    root_norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in g0.values())))
    np.testing.assert_allclose(result.stats["robust_fltrust_root_norm"], root_norm, rtol=1e-5)
    assert {v.worker_id: v.judgement for v in result.verdicts}["evil"] == "discarded"
    assert "evil" not in result.aggregated
    assert set(result.aggregated) == set(HONEST)
    moved = {k: state[k].astype(np.float64) - start[k] for k in start}
    assert np.sqrt(sum(np.sum(m ** 2) for m in moved.values())) <= root_norm * (1 + 1e-4)
    assert sum(float(np.sum(moved[k] * g0[k])) for k in start) > 0   # along g_0, not against it


def test_a_robust_round_keeps_every_update_apart_and_notes_selection_apart_from_discards() -> None:
    result, _ = close_with("multi_krum", poison=-1000.0)
    assert result.stats["selected"] == 5 and result.stats["aggregated"] == len(result.aggregated) <= 4
    assert result.selection is not None and (result.selection.chosen, result.selection.accepted) == (5, 5)
    assert selection_note(1, result.selection) == ""  # `all` chose every update: the discard is the rule's, not a draw


def test_a_robust_rule_is_refused_beside_an_alignment_when_the_service_builds_the_job() -> None:
    book = RoundBook(max_update_bytes=10_000)
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    with pytest.raises(Exception, match="aggregation.robust"):
        book.open_round("j", 1, ["w1"], deadline=math.inf, seed=0,
                        aggregation={"alignment": "feddna", "robust": "median"})


def test_the_coordinator_records_the_rule_s_verdict_on_the_participant(tmp_path: Any) -> None:
    result, _ = close_with("multi_krum", poison=-1000.0)
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    store.add_job("j", "job", json.dumps({}), 1, SPEC.to_json())
    store.open_round("j", 1, [*HONEST, "evil"])
    verdicts = judged(result.verdicts)
    store.close_round("j", 1, model_version=2, aggregated=result.aggregated,
                      updates=[(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in result.updates],
                      accuracy=None, loss=None, seconds=1.0, checkpoint="", stats=result.stats,
                      model_spec_json=SPEC.to_json(),
                      reasons={v.worker_id: f"multi_krum {v.judgement} its update ({v.ratio:.0%} of its share)"
                               for v in verdicts})
    rows = {p.worker_id: p for p in store.participants("j", 1)}
    assert rows["evil"].status == "uploaded" and rows["evil"].reason == "multi_krum discarded its update (0% of its share)"
    assert all(rows[w].reason == "" for w in result.aggregated)
