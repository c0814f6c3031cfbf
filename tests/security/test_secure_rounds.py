"""Secure rounds (aggregation.secure) at the aggregation service, over its real gRPC port: the worker's protocol
steps (`SecureRun`) against the service's session, with dropouts at each step, the refusals, the spool and a
restart. The whole deployment (coordinator, workers over RabbitMQ) is tests/integration/test_secure_round.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.secure_rounds import SecureRounds
from fedbroker.aggregators.service import serve
from fedbroker.errors import Rejection, UploadRejected
from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.job.submission import accept_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.secagg import sum_error_bound
from fedbroker.secagg.secure_round import round_params
from fedbroker.worker.secure_task import SecureRun, SecureStepFailed, weighted_vector
from tests.security.conftest import token_table
from tests.security.secure_service import secure_service

MODEL = {"input_shape": [6], "layers": [{"type": "Linear", "in_features": 6, "out_features": 5}, {"type": "ReLU"},
                                        {"type": "Linear", "in_features": 5, "out_features": 3}]}
SPEC = parse_model(MODEL)
SPEC_JSON = SPEC.to_json()
WORKERS = ["w1", "w2", "w3", "w4", "w5"]
SAMPLES = {"w1": 100, "w2": 250, "w3": 40, "w4": 310, "w5": 77}
JOB, ROUND = "job-s", 1


def secure_counts() -> dict[str, float]:
    """The secure rounds' counters now (outcomes, dropped workers per stage, the reconstructions timed)."""
    def value(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    counts = {o: value("fedbroker_aggregator_secure_rounds_total", {"outcome": o})
              for o in ("closed", "too_few_survivors", "failed", "lost", "abandoned")}
    counts |= {f"dropped_{s}": value("fedbroker_aggregator_secure_workers_dropped_total", {"stage": s})
               for s in ("keys", "shares", "upload", "unmask")}
    counts["reconstructions"] = value("fedbroker_aggregator_secure_unmask_seconds_count", {"part": "reconstruct"})
    counts["waits"] = value("fedbroker_aggregator_secure_unmask_seconds_count", {"part": "wait"})
    return counts


def moved(before: dict[str, float]) -> dict[str, float]:
    """The counters that moved since `before`, by how much."""
    return {k: v - before[k] for k, v in secure_counts().items() if v != before[k]}


def refusals(call: str, reason: Rejection) -> float:
    return REGISTRY.get_sample_value("fedbroker_aggregator_secure_refusals_total",
                                     {"grpc_method": call, "reason": reason.value}) or 0.0


def global_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in parameter_shapes(SPEC).items()}


def trained_state(worker: str, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(int(worker[1:]))
    return {n: (a + rng.normal(scale=0.3, size=a.shape)).astype(np.float32) for n, a in base.items()}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[RoundBook, AggregatorClient]]:
    with secure_service(tmp_path, unmask_s=30.0) as running:
        yield running


def open_secure_round(book: RoundBook, base: dict[str, np.ndarray], *, timeout_s: float = 600.0) -> pb.RoundTask:
    book.put_global(JOB, 1, SPEC_JSON, base)
    deadline = time.time() + timeout_s  # after storing the version: on a loaded machine that alone may take a while
    book.open_round(JOB, ROUND, WORKERS, deadline, {"secure": True}, seed=3, num_samples=SAMPLES)
    return pb.RoundTask(job_id=JOB, round=ROUND, model_version=1, deadline_unix=deadline, participants=len(WORKERS),
                        aggregation_json=json.dumps({"secure": True}))


def run_worker(client: AggregatorClient, task: pb.RoundTask, worker: str, base: dict[str, np.ndarray],
               stop_after: str, errors: list[BaseException], runs: dict[str, SecureRun] | None = None) -> None:
    """One worker's steps, stopping (as a crash would) after `stop_after`: keys, masked, uploaded or done."""
    try:
        run = SecureRun(worker_id=worker, task=task, num_samples=SAMPLES[worker], ish=None)
        if runs is not None:
            runs[worker] = run
        run.exchange_keys(client)
        if stop_after == "keys":
            return
        run.mask(trained_state(worker, base), base, SPEC)
        if stop_after == "masked":
            return
        assert run.masked is not None
        client.upload_masked(job_id=JOB, round=ROUND, worker_id=worker, num_samples=SAMPLES[worker], masked=run.masked)
        if stop_after == "uploaded":
            return
        run.unmask(client)
    except BaseException as exc:  # reported to the test thread
        errors.append(exc)


def expected_global(base: dict[str, np.ndarray], survivors: list[str]) -> dict[str, np.ndarray]:
    total = sum(SAMPLES[w] for w in survivors)
    return {n: base[n] + sum(SAMPLES[w] / total * (trained_state(w, base)[n] - base[n]) for w in survivors)
            for n in base}


def test_the_close_gives_the_survivors_weighted_mean_with_a_dropout_before_upload_and_one_before_unmask(service):
    book, client = service
    base = global_state()
    before = secure_counts()
    task = open_secure_round(book, base)
    errors: list[BaseException] = []
    plan = {"w1": "done", "w2": "done", "w3": "masked", "w4": "uploaded", "w5": "done"}
    runs: dict[str, SecureRun] = {}
    threads = [threading.Thread(target=run_worker, args=(client, task, w, base, plan[w], errors, runs))
               for w in WORKERS]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while len(book.status(JOB, ROUND)[0]) < 4 and time.monotonic() < end and not errors:
        time.sleep(0.05)
    assert not errors, errors
    assert book.status(JOB, ROUND)[0] == ["w1", "w2", "w4", "w5"]
    rnd = book.table.jobs[JOB].round  # the service's memory: no accepted update has tensors or a row of the mean
    assert rnd is not None and all(a.tensors is None and a.slot is None for a in rnd.accepted.values())
    assert rnd.rows.mean is None or rnd.rows.mean.count == 0
    result = book.close(JOB, ROUND)  # w3 dropped (its mask keys rebuilt); w4 survives but never unmasks
    for t in threads:
        t.join(60)
    assert not errors, errors
    survivors = ["w1", "w2", "w4", "w5"]
    assert sorted(result.aggregated) == survivors
    _, _, new = book.global_model(JOB)
    want = expected_global(base, survivors)
    share = sum(SAMPLES[w] for w in survivors) / sum(SAMPLES.values())  # what the service divides the sum by
    bound = sum_error_bound(round_params(len(WORKERS)), len(survivors))[0] / share  # the quantisation bound
    for name in want:
        np.testing.assert_allclose(new[name], want[name], atol=bound + 1e-5)
    weights = {u.worker_id: u.weight for u in result.updates}
    runs["w4"].unmask(client)  # a survivor's reply after the sum was unmasked is answered, not refused
    runs["w1"].unmasked = False  # as if its reply had been lost: the retry re-sends the same shares (asked once)
    runs["w1"].unmask(client)
    assert "w3" not in weights and weights["w2"] == pytest.approx(SAMPLES["w2"] / sum(SAMPLES[w] for w in survivors))
    # t = 3 of 5: the sum needs the shares of w1, w2 and w5, so w4 (which never unmasks) had not sent its own
    assert moved(before) == {"closed": 1, "dropped_upload": 1, "dropped_unmask": 1, "reconstructions": 1, "waits": 1}


def test_dwfed_weights_are_applied_before_masking_and_the_close_divides_by_the_survivors_ish(service):
    book, client = service
    base = global_state(3)
    book.put_global(JOB, 1, SPEC_JSON, base)
    deadline = time.time() + 600
    aggregation = {"secure": True, "weighting": "dwfed"}
    book.open_round(JOB, ROUND, WORKERS, deadline, aggregation, seed=3, num_samples=SAMPLES)
    task = pb.RoundTask(job_id=JOB, round=ROUND, model_version=1, deadline_unix=deadline, participants=len(WORKERS),
                        aggregation_json=json.dumps(aggregation))
    ish = {"w1": 0.9, "w2": 0.2, "w3": 0.5, "w4": 0.7, "w5": 0.4}
    errors: list[BaseException] = []

    def run(worker: str) -> None:
        try:
            r = SecureRun(worker_id=worker, task=task, num_samples=SAMPLES[worker], ish=ish[worker])
            r.exchange_keys(client)
            r.mask(trained_state(worker, base), base, SPEC)
            assert r.masked is not None
            client.upload_masked(job_id=JOB, round=ROUND, worker_id=worker, num_samples=SAMPLES[worker],
                                 masked=r.masked, ish=ish[worker])
            r.unmask(client)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in WORKERS]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while len(book.status(JOB, ROUND)[0]) < len(WORKERS) and time.monotonic() < end and not errors:
        time.sleep(0.05)
    book.close(JOB, ROUND)
    for t in threads:
        t.join(60)
    assert not errors, errors
    _, _, new = book.global_model(JOB)
    total = sum(ish.values())
    for name in base:
        want = base[name] + sum(ish[w] / total * (trained_state(w, base)[name] - base[name]) for w in WORKERS)
        np.testing.assert_allclose(new[name], want, atol=1e-5)


def test_waiters_beyond_the_services_waiting_slots_are_answered_at_once_and_the_round_still_completes(service):
    book, client = service
    # no call may wait: every poll is answered "not yet" at once
    book.secure = SecureRounds(book.table, unmask_s=book.secure.unmask_s, waiting_calls=0)
    base = global_state(2)
    task = open_secure_round(book, base)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=run_worker, args=(client, task, w, base, "done", errors)) for w in WORKERS]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while len(book.status(JOB, ROUND)[0]) < len(WORKERS) and time.monotonic() < end and not errors:
        time.sleep(0.05)
    result = book.close(JOB, ROUND)
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(result.aggregated) == WORKERS


def test_the_spool_never_holds_a_clear_or_masked_update(service, tmp_path: Path):
    book, client = service
    base = global_state(1)
    task = open_secure_round(book, base)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=run_worker, args=(client, task, w, base, "uploaded", errors)) for w in WORKERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    files = [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]
    assert not [p for p in files if "round-" in str(p)]  # no update file of any kind
    clear = [weighted_vector(trained_state(w, base), base, SPEC, 1.0).astype(np.float32).tobytes() for w in WORKERS]
    for path in files:
        data = path.read_bytes()
        for vector in clear:
            assert vector[:24] not in data  # not even the first six values of any update


def test_a_second_advertisement_with_other_keys_is_refused_and_the_same_one_is_answered_again(service):
    book, client = service
    task = open_secure_round(book, global_state())
    first = SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None)
    first.advertise(client)
    assert first.length == 6 * 5 + 5 + 5 * 3 + 3 and first.dtype == "uint32"
    again = client.sec_advertise(first._advertisement())  # a retry: the same answer
    assert again.params.threshold == round_params(5).threshold
    other = SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None)
    with pytest.raises(RemoteError) as refused:
        other.advertise(client)
    assert refused.value.reason == Rejection.SECURE_PROTOCOL
    with pytest.raises(RemoteError) as bigger:  # more samples than it registered
        SecureRun(worker_id="w2", task=task, num_samples=SAMPLES["w2"] + 1, ish=None).advertise(client)
    assert bigger.value.reason == Rejection.TOO_MANY_SAMPLES


def test_uploads_that_do_not_fit_the_round_are_refused(service):
    book, client = service
    base = global_state()
    open_secure_round(book, base)
    with pytest.raises(RemoteError) as plain:  # a clear update to a secure round
        client.upload(job_id=JOB, round=ROUND, worker_id="w1", num_samples=10, tensors=base)
    assert plain.value.reason == Rejection.BAD_HEADER
    with pytest.raises(RemoteError) as early:  # masked, but before the worker got its inbox
        client.upload_masked(job_id=JOB, round=ROUND, worker_id="w1", num_samples=10,
                             masked=np.zeros(38, dtype=np.uint32))
    assert early.value.reason in (Rejection.SECURE_PROTOCOL, Rejection.WRONG_SHAPE)
    book.put_global("plain", 1, SPEC_JSON, base)
    book.open_round("plain", 1, WORKERS, time.time() + 60, {}, seed=1)
    with pytest.raises(RemoteError) as masked:  # masked data to a round that is not secure
        client.upload_masked(job_id="plain", round=1, worker_id="w1", num_samples=10,
                             masked=np.zeros(38, dtype=np.uint32))
    assert masked.value.reason == Rejection.BAD_HEADER


def test_a_restarted_service_fails_the_secure_round_by_name(tmp_path: Path):
    book = RoundBook(spool_dir=tmp_path / "spool")
    open_secure_round(book, global_state())
    book.stop()
    before = secure_counts()
    again = RoundBook(spool_dir=tmp_path / "spool")
    assert moved(before) == {"lost": 1}
    try:
        with pytest.raises(UploadRejected, match="restarted during secure round 1") as refused:
            again.secure.advertise(pb.SecAdvertiseRequest(job_id=JOB, round=ROUND, worker_id="w1", num_samples=5,
                                                          cipher_key=bytes(32), mask_key=bytes(32)))
        assert refused.value.reason == Rejection.SECURE_PROTOCOL
    finally:
        again.stop()


def test_a_roster_that_is_not_fixed_by_the_deadline_fails_the_worker_step(service):
    book, client = service
    # roster by 1.5 s: w1's advertise must land before it, or it is refused as late instead (a 0.25 s margin
    # was once missed on a loaded machine)
    task = open_secure_round(book, global_state(), timeout_s=6.0)
    run = SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None)
    before, refused_before = secure_counts(), refusals("SecRoster", Rejection.SECURE_PROTOCOL)
    with pytest.raises((SecureStepFailed, RemoteError)):  # alone on the roster: below the threshold
        run.exchange_keys(client)
    assert moved(before) == {"too_few_survivors": 1, "dropped_keys": 4}  # the four that advertised nothing
    assert refusals("SecRoster", Rejection.SECURE_PROTOCOL) > refused_before
    book.abandon(JOB, ROUND)  # a failed round abandoned later stays counted as failed, once
    assert moved(before) == {"too_few_survivors": 1, "dropped_keys": 4}


def test_an_abandoned_secure_round_is_counted_as_abandoned_and_its_refusals_by_call(service):
    book, client = service
    task = open_secure_round(book, global_state())
    before = secure_counts()
    first = SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None)
    first.advertise(client)
    protocol, samples = (refusals("SecAdvertise", r) for r in (Rejection.SECURE_PROTOCOL, Rejection.TOO_MANY_SAMPLES))
    with pytest.raises(RemoteError):  # other keys for the same worker
        SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None).advertise(client)
    with pytest.raises(RemoteError):  # more samples than registered
        SecureRun(worker_id="w2", task=task, num_samples=SAMPLES["w2"] + 1, ish=None).advertise(client)
    assert refusals("SecAdvertise", Rejection.SECURE_PROTOCOL) == protocol + 1
    assert refusals("SecAdvertise", Rejection.TOO_MANY_SAMPLES) == samples + 1
    book.abandon(JOB, ROUND)
    assert moved(before) == {"abandoned": 1}


def test_submission_names_every_setting_secure_aggregation_cannot_take():
    job = {"name": "s", "category": "c", "model": MODEL, "training": {"rounds": 1},
           "aggregation": {"secure": True, "alignment": "feddna", "selection": "ga", "robust": "none",
                           "weighting_params": {"max_share": 0.5}},
           "schedule": {"mode": "async", "min_clients": 2, "min_workers": 2}}
    with pytest.raises(Exception) as exc:
        accept_job(job)
    fields = {e.field for e in getattr(exc.value, "errors", [exc.value])}
    assert {"aggregation.alignment", "aggregation.selection", "aggregation.weighting_params.max_share",
            "schedule.mode", "schedule.min_clients", "schedule.min_workers"} <= fields
    ok = accept_job({**job, "aggregation": {"secure": True, "weighting": "fedavg"},
                     "schedule": {"min_clients": 3, "min_workers": 4}})
    assert ok.aggregation.secure


def test_with_tokens_a_worker_takes_part_only_as_itself_and_the_coordinator_not_at_all(tmp_path: Path):
    table, tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
    book = RoundBook()
    server, port = serve(book, tokens=table)
    clients = {name: AggregatorClient(f"127.0.0.1:{port}", timeout_s=5, security=ClientSecurity(token=token))
               for name, token in tokens.items()}
    try:
        task = open_secure_round(book, global_state())
        SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None).advertise(clients["w1"])
        with pytest.raises(RemoteError) as other:  # w2's token advertising keys as w1
            SecureRun(worker_id="w1", task=task, num_samples=SAMPLES["w1"], ish=None).advertise(clients["w2"])
        assert other.value.reason == Rejection.PERMISSION_DENIED
        with pytest.raises(RemoteError) as coordinator:  # the Sec* calls are the workers' only
            clients["coordinator"].sec_roster(JOB, ROUND, "w1", until=time.time() + 5)
        assert coordinator.value.reason == Rejection.PERMISSION_DENIED
    finally:
        for client in clients.values():
            client.close()
        server.stop(grace=0)
