"""Secure and robust together (aggregation.secure_group_size): the pure split, the job's checks, and grouped
rounds at the aggregation service over its real gRPC port, each worker's steps run by `SecureRun` in a thread
(as tests/security/test_secure_rounds.py does): the close is the robust rule over the true group means, a
poisoning site moves only its group, a dropout is recovered inside its group, a group below its threshold
fails alone."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.secure_groups import GroupedSession
from fedbroker.errors import UploadRejected
from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.job.submission import accept_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.secagg import sum_error_bound
from fedbroker.secagg.groups import group_of, group_params, group_sizes, split
from fedbroker.secagg.secure_round import round_params, round_seed
from fedbroker.worker.secure_task import SecureRun, SecureStepFailed
from tests.security.secure_service import secure_service

MODEL = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]}
SPEC = parse_model(MODEL)
WORKERS = [f"w{i}" for i in range(1, 21)]
SAMPLES = {f"w{i}": 27 + 13 * i for i in range(1, 26)}
G = 5
AGGREGATION = {"secure": True, "robust": "median", "secure_group_size": G}
SEED = hashlib.sha256(b"a round").digest()


# ----- the pure split -----

def test_the_split_is_a_seeded_permutation_into_groups_of_at_least_g():
    roster = [f"site-{i}" for i in range(23)]
    groups = split(roster, G, SEED)
    assert groups == split(list(reversed(roster)), G, SEED)  # the roster as a set: its order changes nothing
    assert sorted(w for group in groups for w in group) == sorted(roster)
    assert [len(group) for group in groups] == [5, 5, 5, 8] == group_sizes(23, G)
    assert all(len(group) >= G for group in split(roster[:14], G, SEED))
    assert split(roster, G, hashlib.sha256(b"another round").digest()) != groups
    with pytest.raises(ValueError):
        split(roster[:4], G, SEED)


def test_without_the_seed_no_site_can_predict_whom_it_lands_with():
    """Over 400 seeds each pair of sites shares a group about as often as chance says (4/19 for 20 sites in
    groups of 5), and each site lands in each group about a quarter of the time: the seed alone decides."""
    together: Counter[tuple[str, str]] = Counter()
    places: Counter[tuple[str, int]] = Counter()
    seeds = 400
    for s in range(seeds):
        groups = split(WORKERS, G, hashlib.sha256(s.to_bytes(4, "big")).digest())
        for index, group in enumerate(groups):
            together.update(combinations(group, 2))
            places.update((w, index) for w in group)
    chance = seeds * 4 / 19
    assert all(abs(together[pair] - chance) < 0.5 * chance for pair in combinations(sorted(WORKERS), 2))
    assert all(abs(places[(w, k)] - seeds / 4) < 0.4 * seeds / 4 for w in WORKERS for k in range(4))


def test_a_worker_accepts_only_the_settings_of_a_group_size_the_split_makes():
    assert group_params(22, G, 5) == round_params(5) and group_params(22, G, 7) == round_params(7)
    assert group_params(22, G, 22) is None and group_params(22, G, 6) is None and group_params(4, G, 4) is None


# ----- the job's checks -----

def job(aggregation: dict[str, object], schedule: dict[str, object] | None = None) -> dict[str, object]:
    return {"name": "g", "category": "c", "model": MODEL, "training": {"rounds": 1}, "aggregation": aggregation,
            "schedule": schedule or {"min_clients": 3, "min_workers": 15}}


def fields_refused(raw: dict[str, object]) -> set[str]:
    with pytest.raises(Exception) as exc:
        accept_job(raw)
    return {e.field for e in getattr(exc.value, "errors", [exc.value])}


def test_a_group_size_below_five_or_without_secure_or_with_a_rule_that_needs_each_update_is_refused():
    assert "aggregation.secure_group_size" in fields_refused(job({**AGGREGATION, "secure_group_size": 4}))
    assert "aggregation.secure_group_size" in fields_refused(job({**AGGREGATION, "secure": False}))
    assert "aggregation.secure_group_size" in fields_refused(job({**AGGREGATION, "robust": "multi_krum"}))
    assert "schedule.min_workers" in fields_refused(job(AGGREGATION, {"min_clients": 3, "min_workers": 14}))
    # without groups, secure + robust stays refused
    assert "aggregation.robust" in fields_refused(job({"secure": True, "robust": "median"}))
    accepted = accept_job(job({**AGGREGATION, "robust": "trimmed_mean"}))
    assert accepted.aggregation.secure_group_size == G and accepted.aggregation.robust == "trimmed_mean"


def test_a_round_of_fewer_than_three_groups_refuses_every_step_by_name():
    session = GroupedSession(job_id="j", round_number=1, version=1, participants=frozenset(WORKERS[:14]),
                             length=15, opened=0.0, deadline=10.0, clock=lambda: 0.0, group_size=G)
    with pytest.raises(UploadRejected, match="make 2 group"):
        session.of("w1")


# ----- grouped rounds at the service -----

@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[RoundBook, AggregatorClient]]:
    with secure_service(tmp_path, unmask_s=20.0) as running:
        yield running


def base_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in parameter_shapes(SPEC).items()}


def delta(worker: str, poisoned: frozenset[str], *, sign: float = 1.0) -> dict[str, np.ndarray]:
    """A worker's trained − global: small honest noise around +0.1, or +10 everywhere for a poisoner (−10 for
    one whose number is even, when `sign` alternates)."""
    rng = np.random.default_rng(int(worker[1:]))
    return {n: (np.full(s, 10.0 * sign ** int(worker[1:])) if worker in poisoned else 0.1 + rng.normal(scale=0.05, size=s)).astype(np.float32)
            for n, s in parameter_shapes(SPEC).items()}


def run_round(book: RoundBook, client: AggregatorClient, plan: dict[str, str], poisoned: frozenset[str], *,
              workers: list[str] = WORKERS, aggregation: dict[str, object] = AGGREGATION,
              sign: float = 1.0) -> tuple[dict[str, float], dict[str, BaseException]]:
    """Open round 1 with every worker, run each worker's steps up to its plan (keys, masked, done), close it:
    the close's stats, and the workers whose steps failed after the close (with why)."""
    base = base_state()
    book.put_global("job-g", 1, SPEC.to_json(), base)
    deadline = time.time() + 600
    book.open_round("job-g", 1, workers, deadline, aggregation, seed=3,
                    num_samples={w: SAMPLES[w] for w in workers})
    task = pb.RoundTask(job_id="job-g", round=1, model_version=1, deadline_unix=deadline, participants=len(workers))
    errors: dict[str, BaseException] = {}

    def run(worker: str) -> None:
        try:
            secure = SecureRun(worker_id=worker, task=task, num_samples=SAMPLES[worker], ish=None, group_size=G)
            secure.exchange_keys(client)
            if plan.get(worker, "done") == "keys":
                return
            trained = {n: base[n] + d for n, d in delta(worker, poisoned, sign=sign).items()}
            secure.mask(trained, base, SPEC)
            if plan.get(worker, "done") == "masked":
                return
            assert secure.masked is not None
            client.upload_masked(job_id="job-g", round=1, worker_id=worker, num_samples=SAMPLES[worker],
                                 masked=secure.masked)
            secure.unmask(client)
        except BaseException as exc:  # reported to the test thread
            errors[worker] = exc

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    uploads = sum(1 for w in workers if plan.get(w, "done") == "done")
    end = time.monotonic() + 60
    while len(book.status("job-g", 1)[0]) < uploads and time.monotonic() < end and not errors:
        time.sleep(0.05)
    assert not errors, errors
    result = book.close("job-g", 1)
    for t in threads:
        t.join(30)
    return dict(result.stats), errors


def group_means(groups: list[tuple[str, ...]], survivors: set[str], poisoned: frozenset[str], *,
                sign: float = 1.0) -> np.ndarray:
    """Each group's true weighted mean delta over its survivors, flattened in the model's order."""
    names = list(parameter_shapes(SPEC))
    out = []
    for group in groups:
        alive = [w for w in group if w in survivors]
        total = sum(SAMPLES[w] for w in alive)
        out.append(sum(SAMPLES[w] / total * np.concatenate([delta(w, poisoned, sign=sign)[n].ravel() for n in names])
                       for w in alive))
    return np.array(out)


def new_delta(book: RoundBook) -> np.ndarray:
    names = list(parameter_shapes(SPEC))
    _, _, new = book.global_model("job-g")
    base = base_state()
    return np.concatenate([(new[n].astype(np.float64) - base[n]).ravel() for n in names])


def test_the_close_is_the_median_of_the_true_group_means_a_poisoner_moves_only_its_group_a_dropout_is_recovered(
        service):
    book, client = service
    groups = split(WORKERS, G, round_seed("job-g", 1, 1))
    poisoner, dropout = groups[0][0], groups[1][0]  # the dropout masks but never uploads: its group unmasks it
    poisoned = frozenset({poisoner})
    stats, errors = run_round(book, client, {dropout: "masked"}, poisoned)
    assert not errors, errors
    survivors = set(WORKERS) - {dropout}
    means = group_means(groups, survivors, poisoned)
    honest = np.delete(means, 0, axis=0)
    assert np.all(np.abs(means[0] - honest.mean(axis=0)) > 0.5)  # the poison is in its group's mean...
    assert np.all(np.abs(honest - 0.1) < 0.1)                    # ...and in no other
    bound = max(sum_error_bound(round_params(len(g)), len(g))[0] / 0.1 for g in groups)  # shares ≥ 0.1
    got = new_delta(book)
    np.testing.assert_allclose(got, np.median(means, axis=0), atol=bound + 1e-5)
    assert np.all(got <= honest.max(axis=0) + bound) and np.all(got >= honest.min(axis=0) - bound)
    assert (stats["secure_groups_closed"], stats["secure_dropped"], stats["aggregated"]) == (4, 1, 19)


def test_a_group_below_its_threshold_fails_alone_and_the_round_closes_over_the_others(service):
    book, client = service
    groups = split(WORKERS, G, round_seed("job-g", 1, 1))
    lost = groups[2][:3]  # 2 of 5 upload: below the group's threshold of 3
    stats, errors = run_round(book, client, {w: "keys" for w in lost}, frozenset())
    assert set(errors) == set(groups[2][3:])  # its two uploaders are told, by name, that their group failed
    assert all("group 3 of 4 failed" in str(e) and "threshold is 3" in str(e) for e in errors.values())
    assert (stats["secure_groups_closed"], stats["secure_groups_failed"]) == (3, 1)
    means = group_means([g for k, g in enumerate(groups) if k != 2], set(WORKERS) - set(lost), frozenset())
    bound = max(sum_error_bound(round_params(len(g)), len(g))[0] / 0.1 for g in groups)
    np.testing.assert_allclose(new_delta(book), np.median(means, axis=0), atol=bound + 1e-5)


def test_a_service_that_claims_a_group_size_the_split_cannot_make_is_refused_by_the_worker(service):
    book, client = service
    book.put_global("job-g", 1, SPEC.to_json(), base_state())
    deadline = time.time() + 60
    book.open_round("job-g", 1, WORKERS, deadline, AGGREGATION, seed=3, num_samples=SAMPLES)
    task = pb.RoundTask(job_id="job-g", round=1, model_version=1, deadline_unix=deadline, participants=len(WORKERS))
    run = SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None, group_size=G)
    run.advertise(client)  # the service's group of 5: accepted
    assert run.crypto is not None and run.crypto.params == round_params(G)
    liar = SecureRun(worker_id="w2", task=task, num_samples=SAMPLES["w2"], ish=None, group_size=7)
    with pytest.raises(SecureStepFailed, match="other secure settings"):
        liar.advertise(client)  # groups of 7 in 20 make sizes 7 and 13, never the service's 5
    assert group_of(split(WORKERS, G, round_seed("job-g", 1, 1)), "w1") >= 0
    book.abandon("job-g", 1)


def test_a_round_left_with_fewer_than_three_groups_fails_naming_each_failed_group(service):
    book, client = service
    groups = split(WORKERS, G, round_seed("job-g", 1, 1))
    lost = groups[0][:3] + groups[3][:3]
    with pytest.raises(UploadRejected, match="2 of 4 group") as exc:
        run_round(book, client, {w: "keys" for w in lost}, frozenset())
    assert "group 1 of 4 failed" in str(exc.value) and "group 4 of 4 failed" in str(exc.value)
    version, _, _ = book.global_model("job-g")
    assert version == 1  # no new global model came of it


def test_the_trimmed_mean_over_five_groups_drops_the_two_poisoned_groups_at_either_end(service):
    """25 sites in 5 groups, one poisoner (+10) in one group and one (−10) in another: β 0.2 trims one group
    mean at each end of every coordinate, so the close is the mean of the three honest groups' means (the
    median would be the middle one alone)."""
    book, client = service
    workers = [f"w{i}" for i in range(1, 26)]
    groups = split(workers, G, round_seed("job-g", 1, 1))
    up = next(w for w in groups[0] if int(w[1:]) % 2 == 0)
    down = next(w for w in groups[1] if int(w[1:]) % 2 == 1)
    poisoned = frozenset({up, down})
    aggregation = {**AGGREGATION, "robust": "trimmed_mean", "robust_params": {"beta": 0.2}}
    stats, errors = run_round(book, client, {}, poisoned, workers=workers, aggregation=aggregation, sign=-1.0)
    assert not errors, errors
    means = group_means(groups, set(workers), poisoned, sign=-1.0)
    assert np.all(means[0] > 0.5) and np.all(means[1] < -0.5)
    bound = max(sum_error_bound(round_params(len(g)), len(g))[0] / 0.1 for g in groups)
    got = new_delta(book)
    np.testing.assert_allclose(got, means[2:].mean(axis=0), atol=bound + 1e-5)
    assert np.abs(got - np.median(means, axis=0)).max() > 10 * bound  # not the median's answer
    assert stats["secure_groups_closed"] == 5


def test_the_coordinator_fails_a_grouped_round_only_below_three_groups_thresholds() -> None:
    """A grouped round of 20 (g = 5) closes with 3 groups at threshold: 3·t(5) uploads, fewer than t(20)."""
    from fedbroker.secagg.groups import fewest_uploads
    from fedbroker.secagg.secure_round import needed_uploads, round_params

    assert fewest_uploads(20, 5) == 3 * round_params(5).threshold < needed_uploads(20)
    # 17 sites make groups of 5, 5 and 7: every one of the three must reach its own threshold
    assert fewest_uploads(17, 5) == 2 * round_params(5).threshold + round_params(7).threshold
