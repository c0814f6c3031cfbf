import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fedbroker.datasets import load_dataset
from fedbroker.errors import ConfigError
from fedbroker.worker.partition import partition


def _labels(n: int, num_classes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_classes, size=n)


def _class_shares(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    return np.array([np.bincount(labels[p], minlength=num_classes) / len(p) for p in parts if len(p)])


@pytest.fixture(scope="module")
def digit_labels() -> np.ndarray:
    return load_dataset("digits").y


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 400),
    num_clients=st.integers(1, 12),
    num_classes=st.integers(1, 6),
    scheme=st.sampled_from(["iid", "dirichlet", "classes"]),
    k=st.integers(1, 3),
    alpha=st.floats(0.05, 50.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_sample_is_assigned_to_exactly_one_client(n, num_clients, num_classes, scheme, k, alpha, seed):
    assume(n >= num_clients * k)
    labels = _labels(n, num_classes, seed)
    parts = partition(
        labels, scheme=scheme, num_clients=num_clients, seed=seed, alpha=alpha, classes_per_client=k, min_size=0
    )
    assert len(parts) == num_clients
    assert all(p.dtype == np.int64 for p in parts)
    everything = np.concatenate(parts)
    assert len(everything) == n
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "classes"])
def test_same_seed_gives_the_same_partition_and_another_seed_a_different_one(digit_labels, scheme):
    a = partition(digit_labels, scheme=scheme, num_clients=10, seed=7)
    b = partition(digit_labels, scheme=scheme, num_clients=10, seed=7)
    c = partition(digit_labels, scheme=scheme, num_clients=10, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_split_is_even(digit_labels):
    sizes = [len(p) for p in partition(digit_labels, scheme="iid", num_clients=7, seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_small_dirichlet_alpha_concentrates_each_client_on_few_classes():
    labels = np.repeat(np.arange(10), 1000)
    parts = partition(labels, scheme="dirichlet", num_clients=50, seed=1, alpha=0.1)
    shares = _class_shares(labels, parts, 10)
    assert shares.max(axis=1).mean() > 0.6


def test_large_dirichlet_alpha_gives_clients_near_the_global_proportions():
    labels = np.repeat(np.arange(10), [500, 1000, 1500, 2000, 1000, 1000, 1000, 800, 700, 500])
    global_share = np.bincount(labels) / len(labels)
    parts = partition(labels, scheme="dirichlet", num_clients=50, seed=1, alpha=1000.0)
    shares = _class_shares(labels, parts, 10)
    l1 = np.abs(shares - global_share).sum(axis=1)
    assert l1.mean() < 0.15
    assert shares.max(axis=1).mean() == pytest.approx(global_share.max(), abs=0.03)


def test_dirichlet_concentration_decreases_as_alpha_grows():
    labels = np.repeat(np.arange(10), 600)
    mean_max = [
        _class_shares(labels, partition(labels, scheme="dirichlet", num_clients=40, seed=3, alpha=a), 10)
        .max(axis=1)
        .mean()
        for a in (0.1, 1.0, 10.0, 100.0)
    ]
    assert mean_max == sorted(mean_max, reverse=True)


def test_dirichlet_gives_every_client_at_least_min_size(digit_labels):
    parts = partition(digit_labels, scheme="dirichlet", num_clients=20, seed=0, alpha=0.3, min_size=10)
    assert min(len(p) for p in parts) >= 10


def test_dirichlet_that_cannot_meet_min_size_raises_a_clear_error():
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(ConfigError, match="min_size"):
        partition(labels, scheme="dirichlet", num_clients=20, seed=0, alpha=0.01, min_size=4)


@pytest.mark.parametrize("num_clients", [10, 20, 37])
def test_one_class_per_client_scheme_gives_each_client_a_single_class(digit_labels, num_clients):
    parts = partition(digit_labels, scheme="classes", num_clients=num_clients, seed=0, classes_per_client=1)
    assert [len(np.unique(digit_labels[p])) for p in parts] == [1] * num_clients
    assert {int(c) for p in parts for c in np.unique(digit_labels[p])} == set(range(10))


@pytest.mark.parametrize("num_clients", [10, 50, 100])
def test_two_class_scheme_gives_each_client_two_distinct_classes(digit_labels, num_clients):
    parts = partition(digit_labels, scheme="classes", num_clients=num_clients, seed=0, classes_per_client=2)
    assert [len(np.unique(digit_labels[p])) for p in parts] == [2] * num_clients


def test_two_class_pairings_vary_between_clients(digit_labels):
    parts = partition(digit_labels, scheme="classes", num_clients=50, seed=0, classes_per_client=2)
    pairs = {tuple(np.unique(digit_labels[p])) for p in parts}
    assert len(pairs) > 15


def test_fewer_shards_than_classes_still_assigns_whole_classes(digit_labels):
    parts = partition(digit_labels, scheme="classes", num_clients=4, seed=0, classes_per_client=1)
    classes = [set(np.unique(digit_labels[p]).tolist()) for p in parts]
    assert sum(len(c) for c in classes) == 10  # no class is split between clients


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"scheme": "pathological"}, "scheme"),
        ({"num_clients": 0}, "num_clients"),
        ({"num_clients": 2.5}, "num_clients"),
        ({"scheme": "dirichlet", "alpha": 0.0}, "alpha"),
        ({"scheme": "dirichlet", "alpha": float("nan")}, "alpha"),
        ({"scheme": "classes", "classes_per_client": 0}, "classes_per_client"),
        ({"min_size": -1}, "min_size"),
        ({"num_clients": 11, "min_size": 10}, "num_clients"),
    ],
)
def test_bad_arguments_raise_an_error_naming_the_argument(kwargs, field):
    args = {"scheme": "iid", "num_clients": 3, "seed": 0} | kwargs
    with pytest.raises(ConfigError) as info:
        partition(np.arange(100) % 5, **args)
    assert info.value.field == field


def test_non_integer_labels_are_rejected():
    with pytest.raises(ConfigError, match="labels"):
        partition(np.linspace(0, 1, 10), scheme="iid", num_clients=2, seed=0)
