"""One dishonest site against a secure round, at a real `fedbroker aggregator` process over its gRPC port. The
test plays the coordinator's calls (install, open, close) and the sites' (`SecureRun`, the worker's own protocol
code), one of them lying where SECURITY.md's "Secure rounds" table says: garbled or 3 MB sealed shares (caught
before anyone trains, the dealer excluded and named, the round completes when its threshold holds, and nobody
trains when it does not) and a survivor that shifts a share it reveals (refused and named; the sum is rebuilt
from the honest shares, never the corrupted one). A failed round is answered at once to the sites waiting on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.secagg import PublicKeys, shamir, sum_error_bound
from fedbroker.secagg.secure_round import round_params
from fedbroker.worker.secure_task import SecureRun, SecureStepFailed
from tests.installed import install
from tests.integration.processes import Deployment
from tests.security.test_secure_rounds import (
    JOB,
    ROUND,
    SAMPLES,
    SPEC,
    SPEC_JSON,
    WORKERS,
    expected_global,
    global_state,
    trained_state,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Shares = dict[str, bytes]
# The deadline test waits its round's deadline out by design: short, far above the second or so the five sites'
# keys and two uploads take (all in this process); the roster is fixed once every site advertised.
FAILING_ROUND_S = 15


@pytest.fixture
def aggregator(rabbitmq_url: str, tmp_path: Path) -> Iterator[AggregatorClient]:
    """A real aggregation service process; the client the test speaks to it with (as coordinator and sites)."""
    d = Deployment(rabbitmq_url, tmp_path, name="secure-adv", worker_ids=[])
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": tmp_path / "spool"})
    client = AggregatorClient(d.aggregator)
    try:
        end = time.monotonic() + 120
        while True:  # a hang guard while the process starts, not a timing the test relies on
            d.alive("aggregator")
            try:
                client.put_global(JOB, 1, SPEC_JSON, global_state())
                break
            except RemoteError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.5)
        yield client
    finally:
        client.close()
        d.close()


def open_round(client: AggregatorClient, *, timeout_s: float = 240) -> pb.RoundTask:
    deadline = time.time() + timeout_s
    install(client, JOB, {"secure": True})  # as the coordinator does, once per job (again: the same settings)
    client.open_round(JOB, ROUND, WORKERS, deadline, seed=3, num_samples=SAMPLES)
    return pb.RoundTask(job_id=JOB, round=ROUND, model_version=1, deadline_unix=deadline, participants=len(WORKERS),
                        aggregation_json='{"secure": true}')


def in_threads(fn: Callable[[str], None], workers: list[str]) -> dict[str, BaseException]:
    """`fn(worker)` for each worker at once (the waits are long polls on the others); the errors by worker."""
    errors: dict[str, BaseException] = {}

    def run(worker: str) -> None:
        try:
            fn(worker)
        except BaseException as exc:  # reported to the test thread
            errors[worker] = exc

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return errors


def dishonest_dealer(client: AggregatorClient, task: pb.RoundTask, worker: str,
                     corrupt: Callable[[Shares], Shares]) -> None:
    """A site that advertises honestly, then sends `corrupt` of its sealed shares, then asks for its verdict."""
    run = SecureRun(worker_id=worker, task=task, num_samples=SAMPLES[worker], ish=None)
    run.advertise(client)
    assert run.crypto is not None
    roster = client.sec_roster(JOB, ROUND, worker, until=task.deadline_unix)
    assert roster is not None
    shares = run.crypto.share_keys({p.worker_id: PublicKeys(c_pk=p.cipher_key, s_pk=p.mask_key) for p in roster.peers})
    client.sec_share(pb.SecShareRequest(job_id=JOB, round=ROUND, worker_id=worker, ciphertexts=[
        pb.SecCiphertext(peer=p, data=d) for p, d in sorted(corrupt(shares).items())]))  # refused if not its size
    assert client.sec_inbox(JOB, ROUND, worker, until=task.deadline_unix) is not None  # as a site, in order
    client.sec_verify(JOB, ROUND, worker, {}, until=task.deadline_unix)  # refused: it was excluded


def honest_until_masked(client: AggregatorClient, task: pb.RoundTask, runs: dict[str, SecureRun],
                        trained: list[str]) -> Callable[[str], None]:
    """A site's steps up to its masked upload; it "trains" (is listed in `trained`) only once its keys and
    verdict are through, as the worker's agent does."""
    base = global_state()

    def steps(worker: str) -> None:
        run = runs[worker] = SecureRun(worker_id=worker, task=task, num_samples=SAMPLES[worker], ish=None)
        run.exchange_keys(client)
        trained.append(worker)
        run.mask(trained_state(worker, base), base, SPEC)
        assert run.masked is not None
        client.upload_masked(job_id=JOB, round=ROUND, worker_id=worker, num_samples=SAMPLES[worker], masked=run.masked)

    return steps


def close_in_thread(client: AggregatorClient) -> tuple[threading.Thread, list[pb.CloseRoundReply | BaseException]]:
    out: list[pb.CloseRoundReply | BaseException] = []

    def close() -> None:
        try:
            out.append(client.close_round(JOB, ROUND))
        except BaseException as exc:  # reported to the test thread
            out.append(exc)

    thread = threading.Thread(target=close)
    thread.start()
    return thread, out


def assert_model_is_the_mean_of(client: AggregatorClient, survivors: list[str]) -> None:
    _, _, model = client.download(JOB, 2)
    want = expected_global(global_state(), survivors)
    bound = sum_error_bound(round_params(len(WORKERS)), len(survivors))[0] * len(WORKERS)
    for name in want:
        np.testing.assert_allclose(model[name], want[name], atol=bound + 1e-5)


def garble(shares: Shares) -> Shares:
    """The protocol's size, with the commitments kept and the sealed part replaced: no recipient can open it."""
    return {p: m[:64] + bytes(len(m) - 64) for p, m in shares.items()}


def oversize(shares: Shares) -> Shares:
    """One peer's message padded to 3 MB (under gRPC's message limit: the protocol's own bound refuses it)."""
    first = min(shares)
    return {**shares, first: shares[first] + bytes(3_000_000)}


@pytest.mark.parametrize("corrupt", [garble, oversize], ids=["garbled", "3MB"])
def test_a_site_with_bad_shares_is_excluded_and_named_before_anyone_trains_and_the_round_completes_without_it(
        aggregator: AggregatorClient, corrupt: Callable[[Shares], Shares]) -> None:
    client, bad = aggregator, "w5"
    task = open_round(client)
    runs: dict[str, SecureRun] = {}
    trained: list[str] = []
    honest = [w for w in WORKERS if w != bad]
    errors = in_threads(lambda w: dishonest_dealer(client, task, w, corrupt) if w == bad
                        else honest_until_masked(client, task, runs, trained)(w), WORKERS)
    assert set(errors) == {bad} and isinstance(errors[bad], RemoteError), errors
    assert (f"worker {bad!r} was excluded" if corrupt is garble else f"share message from {bad!r} is 30") in str(
        errors[bad])
    assert sorted(trained) == honest
    assert all(runs[w].excluded == ({bad} if corrupt is garble else set()) for w in honest)
    thread, out = close_in_thread(client)
    assert not in_threads(lambda w: runs[w].unmask(client), honest)
    thread.join(120)
    (reply,) = out
    assert isinstance(reply, pb.CloseRoundReply), reply
    assert sorted(reply.aggregated) == honest
    assert list(reply.excluded) == [bad]
    assert_model_is_the_mean_of(client, honest)


def test_when_bad_shares_leave_fewer_than_the_threshold_no_honest_site_trains(aggregator: AggregatorClient) -> None:
    client, bad = aggregator, ["w3", "w4", "w5"]  # five sites, threshold 3: two honest ones cannot complete it
    task = open_round(client)
    runs: dict[str, SecureRun] = {}
    trained: list[str] = []
    errors = in_threads(lambda w: dishonest_dealer(client, task, w, garble) if w in bad
                        else honest_until_masked(client, task, runs, trained)(w), WORKERS)
    assert trained == []  # nobody spent ε on it
    for w in ("w1", "w2"):
        assert isinstance(errors[w], RemoteError), errors
        assert "2 workers remain after verification, the threshold is 3" in str(errors[w])
        assert all(f"'{b}'" in str(errors[w]) for b in bad)  # the bad dealers are named


def test_a_survivor_that_shifts_its_unmask_shares_is_refused_by_name_and_the_model_is_never_the_corrupted_sum(
        aggregator: AggregatorClient) -> None:
    client, cheat = aggregator, "w4"
    task = open_round(client)
    runs: dict[str, SecureRun] = {}
    assert not in_threads(honest_until_masked(client, task, runs, []), WORKERS)
    thread, out = close_in_thread(client)
    named = client.sec_survivors(JOB, ROUND, cheat, until=task.deadline_unix + 60)
    assert named is not None and set(named.survivors) == set(WORKERS)
    crypto = runs[cheat].crypto
    assert crypto is not None
    shares = crypto.unmask(list(named.survivors), list(named.dropped))
    shifted = {p: shamir.encode_share((shamir.decode_share(s) + 24) % shamir.PRIME) if p != cheat else s
               for p, s in shares.items()}
    with pytest.raises(RemoteError, match=f"unmask reply from '{cheat}'.*does not match the dealer's commitment"):
        client.sec_unmask(pb.SecUnmaskRequest(job_id=JOB, round=ROUND, worker_id=cheat, shares=[
            pb.SecShareValue(peer=p, share=s) for p, s in sorted(shifted.items())]))
    # The cheat's reply came first; exactly t honest ones follow (before, t replies closed the round, cheat included).
    for w in ("w1", "w2", "w3"):
        runs[w].unmask(client)
    thread.join(120)
    (reply,) = out
    assert isinstance(reply, pb.CloseRoundReply), reply
    assert sorted(reply.aggregated) == WORKERS  # its own masked input is in the sum, as any site's input is
    assert list(reply.excluded) == [cheat]
    assert_model_is_the_mean_of(client, WORKERS)


def test_a_round_abandoned_by_the_coordinator_answers_its_waiting_sites_at_once(aggregator: AggregatorClient) -> None:
    client = aggregator
    task = open_round(client)
    runs: dict[str, SecureRun] = {}
    uploaders = ["w1", "w2"]  # w3..w5 drop after their keys: 2 uploads, threshold 3
    assert not in_threads(lambda w: honest_until_masked(client, task, runs, [])(w) if w in uploaders
                          else runs.setdefault(w, SecureRun(worker_id=w, task=task, num_samples=SAMPLES[w],
                                                            ish=None)).exchange_keys(client), WORKERS)
    waiting: dict[str, BaseException] = {}
    threads = [threading.Thread(target=lambda w=w: waiting.setdefault(w, _raised(lambda: runs[w].unmask(client))))
               for w in uploaders]
    for t in threads:
        t.start()
    client.abandon_round(JOB, ROUND)  # as the coordinator does when the round fails (2 uploads, threshold 3)
    for t in threads:
        t.join(120)
    for w in uploaders:  # answered by the service, naming why (a site that asks after the abandon finds the round
        # gone), not by their own wait running out at the deadline plus the unmask wait
        assert isinstance(waiting[w], RemoteError), waiting
        assert "was abandoned" in str(waiting[w]) or "round 1 of job 'job-s' is not open" in str(waiting[w]), waiting
        assert not isinstance(waiting[w], SecureStepFailed)


def test_a_round_whose_deadline_passes_below_its_threshold_fails_at_the_service_and_tells_its_waiting_sites(
        aggregator: AggregatorClient) -> None:
    """No coordinator tells it: at the deadline no masked upload can come, so 2 of threshold 3 cannot close."""
    client = aggregator
    task = open_round(client, timeout_s=FAILING_ROUND_S)
    runs: dict[str, SecureRun] = {}
    uploaders = ["w1", "w2"]
    assert not in_threads(lambda w: honest_until_masked(client, task, runs, [])(w) if w in uploaders
                          else SecureRun(worker_id=w, task=task, num_samples=SAMPLES[w], ish=None).exchange_keys(client),
                          WORKERS)
    waiting = {w: _raised(lambda w=w: runs[w].unmask(client)) for w in uploaders}  # wait past the deadline
    for w in uploaders:
        assert isinstance(waiting[w], RemoteError), waiting
        assert "deadline passed with 2 masked upload(s); its threshold is 3" in str(waiting[w])


def _raised(fn: Callable[[], None]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # what the waiting site was told
        return exc
    return None
