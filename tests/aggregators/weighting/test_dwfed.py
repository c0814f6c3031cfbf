"""DWFed: EMD against the population, ISH (eq. 12, both readings) and normalised weights (eq. 13)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.weighting import DWFedWeighting, UpdateMeta
from fedbroker.label_stats import emd, ish, label_distribution, population_distribution

FORMS = ("ratio", "one_minus")


def dwfed_weights(distances: list[float], form: str) -> np.ndarray:
    """What the service ends up with: every worker reports ISH(D_k, K), the service normalises."""
    algo = DWFedWeighting(ish_form=form)
    k = len(distances)
    metas = [UpdateMeta(worker_id=f"w{i}", num_samples=10, ish=ish(d, k, form)) for i, d in enumerate(distances)]
    raw = np.array([algo.raw_weight(meta) for meta in metas])
    weights, _ = algo.normalise(raw)
    return weights


def test_population_distribution_pools_counts_over_all_workers() -> None:
    assert np.allclose(population_distribution([[3, 1], [0, 4]]), [3 / 8, 5 / 8])


def test_label_distribution_and_emd_of_the_worked_example() -> None:
    p_big = label_distribution([10, 0])
    assert np.allclose(p_big, [1.0, 0.0])
    assert emd(p_big, [0.5, 0.5]) == pytest.approx(1.0)
    assert emd([0.5, 0.5], [0.5, 0.5]) == 0.0
    assert emd([1.0, 0.0], [0.0, 1.0]) == pytest.approx(2.0)


@pytest.mark.parametrize("form", FORMS)
def test_all_distances_zero_give_uniform_weights(form: str) -> None:
    histograms = [[5, 5, 5], [1, 1, 1], [20, 20, 20], [2, 2, 2]]
    population = population_distribution(histograms)
    distances = [emd(label_distribution(h), population) for h in histograms]
    assert distances == pytest.approx([0.0] * 4)
    assert np.allclose(dwfed_weights(distances, form), 0.25)


@pytest.mark.parametrize(("form", "expected"), [("ratio", [0.2, 0.8]), ("one_minus", [0.428571, 0.571429])])
def test_two_worker_example_from_algorithms_md(form: str, expected: list[float]) -> None:
    population = np.array([0.5, 0.5])
    distances = [emd([1.0, 0.0], population), emd([0.5, 0.5], population)]
    assert np.allclose(dwfed_weights(distances, form), expected, atol=1e-6)


def test_ish_closed_forms() -> None:
    assert ish(1.0, 2, "ratio") == pytest.approx(0.25)
    assert ish(1.0, 2, "one_minus") == pytest.approx(0.75)
    assert ish(0.0, 7, "ratio") == ish(0.0, 7, "one_minus") == 1.0


@settings(max_examples=200, deadline=None)
@given(
    distances=st.lists(st.floats(min_value=0.0, max_value=2.0), min_size=1, max_size=12),
    form=st.sampled_from(FORMS),
)
def test_weights_sum_to_one_and_never_increase_with_distance(distances: list[float], form: str) -> None:
    weights = dwfed_weights(distances, form)
    assert weights.sum() == pytest.approx(1.0)
    assert np.all(weights >= 0)
    order = np.argsort(distances, kind="stable")
    assert np.all(np.diff(weights[order]) <= 1e-12)


@settings(max_examples=100, deadline=None)
@given(
    distances=st.lists(st.floats(min_value=0.0, max_value=2.0), min_size=2, max_size=8),
    bump=st.floats(min_value=0.0, max_value=2.0),
    form=st.sampled_from(FORMS),
)
def test_raising_one_workers_distance_never_raises_its_weight(distances: list[float], bump: float, form: str) -> None:
    before = dwfed_weights(distances, form)[0]
    after = dwfed_weights([min(2.0, distances[0] + bump), *distances[1:]], form)[0]
    assert after <= before + 1e-12


def test_dwfed_without_ish_names_the_worker() -> None:
    with pytest.raises(ValueError, match="w7"):
        DWFedWeighting().raw_weight(UpdateMeta(worker_id="w7", num_samples=3))


@pytest.mark.parametrize(
    ("form", "bad"), [("ratio", 1.5), ("ratio", -0.5), ("one_minus", 0.2), ("ratio", float("nan"))]
)
def test_reported_ish_outside_what_eq12_can_produce_is_rejected(form: str, bad: float) -> None:
    with pytest.raises(ValueError, match="w1"):
        DWFedWeighting(ish_form=form).raw_weight(UpdateMeta(worker_id="w1", num_samples=3, ish=bad))


def test_single_worker_with_negative_ratio_ish_falls_back_to_uniform() -> None:
    algo = DWFedWeighting()
    value = algo.ish_for(2.0, 1)
    assert value < 0
    raw = np.array([algo.raw_weight(UpdateMeta(worker_id="solo", num_samples=3, ish=value))])
    weights, fell_back = algo.normalise(raw)
    assert weights.tolist() == [1.0] and fell_back


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ish(2.5, 2), "distance"),
        (lambda: ish(0.5, 0), "num_aggregated"),
        (lambda: ish(0.5, 2, "square"), "ish_form"),
        (lambda: label_distribution([0, 0]), "no samples"),
        (lambda: label_distribution([1, -1]), ">= 0"),
        (lambda: population_distribution([[1, 2], [1, 2, 3]]), "same number of labels"),
        (lambda: emd([1.0, 0.0], [1.0]), "same length"),
    ],
)
def test_helpers_reject_bad_input(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
