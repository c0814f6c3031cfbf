"""A distributed-DP secure round (privacy.distributed) at the aggregation service's handlers, no network: the round's
settings, the declared noise variances, the quorum, a restart, and the close's DP-SGD step and record. The real
deployment is tests/integration/test_distributed_dp_e2e.py."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from fedbroker.aggregators import secure_ddp
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.errors import Rejection, UploadRejected
from fedbroker.job.privacy import DistributedDP
from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.secagg import SecAggClient
from fedbroker.secagg.ddp_record import from_json, from_stats
from fedbroker.secagg.secure_round import ddp_round_params, round_params
from fedbroker.secagg.skellam import DDPRound

MODEL = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]}
SPEC = parse_model(MODEL)
D = sum(int(np.prod(s)) for s in parameter_shapes(SPEC).values())
WORKERS = ["w1", "w2", "w3", "w4", "w5"]
SAMPLES = {"w1": 100, "w2": 250, "w3": 40, "w4": 310, "w5": 77}
JOB, ROUND, LR = "job-ddp", 1, 0.5
DIST = DistributedDP(enabled=True, noise_multiplier=1.2, clip=1.0, sample_rate=0.1, quorum=4)


def settings(distributed: DistributedDP = DIST) -> pb.JobSettings:
    from fedbroker.job.settings import sections_settings  # the installed job as the coordinator sends it
    message = sections_settings(JOB, training={"lr": LR}, aggregation={"secure": True})
    if distributed.enabled:
        message.privacy.distributed.CopyFrom(pb.DistributedDPSettings(
            enabled=True, noise_multiplier=distributed.noise_multiplier, clip=distributed.clip,
            sample_rate=distributed.sample_rate, quorum=distributed.quorum))
    return message


def base_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in parameter_shapes(SPEC).items()}


@pytest.fixture
def book(tmp_path: Path) -> Iterator[RoundBook]:
    b = RoundBook(spool_dir=tmp_path / "spool", secure_unmask_s=20.0)
    try:
        yield b
    finally:
        b.stop()


def open_round(book: RoundBook, distributed: DistributedDP = DIST, *, workers: list[str] = WORKERS) -> None:
    book.installed.install(settings(distributed))
    book.put_global(JOB, 1, SPEC.to_json(), base_state())
    book.open_round(JOB, ROUND, workers, time.time() + 600, seed=3, num_samples={w: SAMPLES[w] for w in workers})


def the_ddp() -> DDPRound:
    return ddp_round_params(participants=len(WORKERS), distributed=DIST, dimension=D, records=sum(SAMPLES.values()))


def share(ddp: DDPRound) -> float:
    return ddp.share_variance


class Site:
    """One worker's protocol steps against the book's handlers (as secure_task runs them over gRPC)."""

    def __init__(self, book: RoundBook, worker: str) -> None:
        self.book, self.worker = book, worker
        session = book.table.job(JOB).round.secure  # type: ignore[union-attr]
        assert session is not None
        self.crypto = SecAggClient(worker, session.params, session.seed, np.random.default_rng(int(worker[1:])))
        self.excluded: frozenset[str] = frozenset()
        self.opened = False

    def wait(self) -> pb.SecWaitRequest:
        return pb.SecWaitRequest(job_id=JOB, round=ROUND, worker_id=self.worker, wait_s=0.0)

    def advertise(self, variance: float) -> None:
        keys = self.crypto.advertise()
        self.book.secure.advertise(pb.SecAdvertiseRequest(
            job_id=JOB, round=ROUND, worker_id=self.worker, cipher_key=keys.c_pk, mask_key=keys.s_pk,
            num_samples=SAMPLES[self.worker], noise_variance=variance))

    def exchange(self) -> None:
        roster = self.book.secure.roster(self.wait())
        assert roster is not None
        sealed = self.crypto.share_keys(roster.peers)
        self.book.secure.share(pb.SecShareRequest(job_id=JOB, round=ROUND, worker_id=self.worker, ciphertexts=[
            pb.SecCiphertext(peer=p, data=d) for p, d in sorted(sealed.items())]))

    def verify(self) -> frozenset[str] | None:
        """Opens the inbox (once) and reports; the round's exclusions once every site reported (else None)."""
        if not self.opened:
            box = self.book.secure.inbox(self.wait())
            assert box is not None
            assert not self.crypto.open_inbox(box)
            self.opened = True
        verdict = self.book.secure.verify(pb.SecVerifyRequest(job_id=JOB, round=ROUND, worker_id=self.worker,
                                                               wait_s=0.0))
        self.excluded = verdict or frozenset()
        return verdict

    def upload(self, levels: np.ndarray) -> None:
        masked = self.crypto.masked_integers(levels, self.excluded)
        tensors = {"masked": masked}
        header = pb.UpdateHeader(job_id=JOB, round=ROUND, worker_id=self.worker, num_samples=SAMPLES[self.worker],
                                 tensors=codec.tensor_specs(tensors), masked=True)
        self.book.receive_update(codec.as_stream(pb.UpdateChunk, header, codec.joined(tensors),
                                                 codec.tensors_sha256(tensors)))

    def unmask(self) -> None:
        named = None
        while named is None:
            named = self.book.secure.survivors(pb.SecWaitRequest(job_id=JOB, round=ROUND, worker_id=self.worker,
                                                                 wait_s=1.0))
        shares = self.crypto.unmask(sorted(named.survivors), sorted(named.dropped))
        self.book.secure.unmask(pb.SecUnmaskRequest(job_id=JOB, round=ROUND, worker_id=self.worker, shares=[
            pb.SecShareValue(peer=p, share=s) for p, s in sorted(shares.items())]))


def keyed(book: RoundBook, variances: Mapping[str, float]) -> dict[str, Site]:
    """Every site advertised (with its variance), shared and verified: ready to mask."""
    sites = {w: Site(book, w) for w in WORKERS}
    for w, site in sites.items():
        site.advertise(variances[w])
    for site in sites.values():
        site.exchange()
    for site in sites.values():
        site.verify()
    for site in sites.values():  # fixed once every site reported: each reads the (empty) exclusions
        assert site.verify() == frozenset()
    return sites


def ring_levels(values: np.ndarray, bits: int) -> np.ndarray:
    """Signed integers as ring elements mod 2^bits (as a worker hands them to masking)."""
    dtype = np.uint32 if bits <= 32 else np.uint64
    return (values.astype(np.int64).astype(np.uint64) & np.uint64((1 << bits) - 1)).astype(dtype)


def test_the_round_runs_the_settings_both_ends_derive_and_the_advertise_reply_names_them(book: RoundBook) -> None:
    open_round(book)
    session = book.table.job(JOB).round.secure  # type: ignore[union-attr]
    ddp = the_ddp()
    assert session is not None and session.ddp == ddp and session.quorum == DIST.quorum
    assert session.params.bits == ddp.bits and session.params.threshold == round_params(len(WORKERS)).threshold
    sent = secure_ddp.sec_params(session, pb.SecParams())
    assert (sent.ddp_scale, sent.ddp_bits, sent.ddp_quorum, sent.ddp_records) == (
        ddp.scale, ddp.bits, DIST.quorum, sum(SAMPLES.values()))


@pytest.mark.parametrize("declared", [math.nan, -1.0, math.inf, 1e30, 0.0])
def test_a_declared_noise_variance_that_is_not_a_sane_share_is_refused_naming_the_field(
        book: RoundBook, declared: float) -> None:
    open_round(book)
    site = Site(book, "w1")
    with pytest.raises(UploadRejected) as caught:
        site.advertise(declared)
    assert caught.value.reason == Rejection.BAD_HEADER
    assert "SecAdvertiseRequest.noise_variance" in str(caught.value) and "'w1'" in str(caught.value)
    assert "w1" not in book.table.job(JOB).round.secure.noise  # type: ignore[union-attr]


def test_below_its_share_is_refused_and_a_sane_share_is_taken(book: RoundBook) -> None:
    open_round(book)
    ddp = the_ddp()
    with pytest.raises(UploadRejected, match=r"noise_variance .* outside"):
        Site(book, "w1").advertise(share(ddp) * 0.9)
    Site(book, "w2").advertise(share(ddp))
    assert book.table.job(JOB).round.secure.noise == {"w2": share(ddp)}  # type: ignore[union-attr]


def test_a_worker_that_adds_noise_in_a_plain_secure_round_runs_other_settings_and_is_refused(book: RoundBook) -> None:
    open_round(book, DistributedDP())
    with pytest.raises(UploadRejected, match=r"noise_variance 3.0 in a secure round without privacy.distributed"):
        Site(book, "w1").advertise(3.0)


def test_a_quorum_above_the_participants_cannot_open_a_round(book: RoundBook) -> None:
    with pytest.raises(UploadRejected, match=r"privacy.distributed.quorum.*cannot reach a quorum of 4"):
        open_round(book, workers=WORKERS[:3])


def test_fewer_survivors_than_the_quorum_fail_the_round_before_anything_is_unmasked(book: RoundBook) -> None:
    open_round(book)
    ddp = the_ddp()
    sites = keyed(book, {w: share(ddp) for w in WORKERS})
    for w in ("w1", "w2", "w3"):  # three of five mask: the threshold (3) holds, the quorum (4) does not
        sites[w].upload(ring_levels(np.arange(D), ddp.bits))
    with pytest.raises(UploadRejected) as caught:
        book.close(JOB, ROUND)
    assert caught.value.reason == Rejection.SECURE_PROTOCOL
    assert "3 masked upload(s) arrived; the round's quorum is 4" in str(caught.value)
    with pytest.raises(UploadRejected, match="quorum is 4"):  # a survivor asking whom to unmask is told why
        book.secure.survivors(sites["w1"].wait())
    assert book.table.job(JOB).version == 1  # no new model


def test_the_close_takes_one_dp_sgd_step_from_the_survivors_sum_and_records_its_noise(book: RoundBook) -> None:
    open_round(book)
    ddp = the_ddp()
    variances = {w: share(ddp) * (1 + i / 4) for i, w in enumerate(WORKERS)}  # up to 2 shares (a local floor)
    sites = keyed(book, variances)
    rng = np.random.default_rng(7)
    sums = {w: rng.integers(-5000, 5000, size=D) for w in WORKERS}  # each site's γ·(gradient sum + its noise)
    survivors = ["w1", "w2", "w4", "w5"]  # w3 crashes after masking, before its upload
    for w in survivors:
        sites[w].upload(ring_levels(sums[w], ddp.bits))
    result: list[object] = []
    closing = threading.Thread(target=lambda: result.append(book.close(JOB, ROUND)))
    closing.start()
    for w in survivors:
        sites[w].unmask()
    closing.join(30)
    (closed,) = result
    total = sum(sums[w] for w in survivors) / ddp.scale
    records = sum(SAMPLES[w] for w in survivors)
    want = np.concatenate([a.ravel() for a in base_state().values()]) - LR * total / (DIST.sample_rate * records)
    _, _, after = book.global_model(JOB)
    np.testing.assert_allclose(np.concatenate([a.ravel() for a in after.values()]), want, rtol=1e-6, atol=1e-6)
    record = from_stats(closed.stats)  # type: ignore[attr-defined]
    assert record.survivors == survivors and record.records == records and record.lr == LR
    assert record.variances == {w: variances[w] for w in survivors}
    assert record.total_variance == pytest.approx(sum(variances[w] for w in survivors))
    assert record.conservative and record.quorum_variance == pytest.approx(ddp.full_variance)
    assert (record.bits, record.scale, record.wrap_bound, record.quorum) == (
        ddp.bits, ddp.scale, ddp.wrap_probability, DIST.quorum)
    assert from_json(record.to_json()) == record


def test_a_restarted_service_refuses_every_step_of_the_distributed_dp_round(tmp_path: Path) -> None:
    first = RoundBook(spool_dir=tmp_path / "spool", secure_unmask_s=5.0)
    open_round(first)
    Site(first, "w1").advertise(share(the_ddp()))
    first.stop()
    again = RoundBook(spool_dir=tmp_path / "spool", secure_unmask_s=5.0)
    try:
        keys = SecAggClient("w2", round_params(5), b"0" * 32, np.random.default_rng(0)).advertise()
        with pytest.raises(UploadRejected, match="restarted during secure round 1"):  # not a settings mismatch
            again.secure.advertise(pb.SecAdvertiseRequest(job_id=JOB, round=ROUND, worker_id="w2", num_samples=250,
                                                          cipher_key=keys.c_pk, mask_key=keys.s_pk,
                                                          noise_variance=share(the_ddp())))
        with pytest.raises(UploadRejected, match="restarted"):  # nor is a site that advertised before told otherwise
            again.secure.roster(pb.SecWaitRequest(job_id=JOB, round=ROUND, worker_id="w1", wait_s=0.0))
    finally:
        again.stop()


class NamingClient:
    """A dishonest service's answers at the close: it names `survivors`, and records any unmask shares sent to it."""

    def __init__(self, survivors: list[str], dropped: list[str]) -> None:
        self.named = pb.SecSurvivorsReply(ready=True, survivors=survivors, dropped=dropped)
        self.sent: list[pb.SecUnmaskRequest] = []

    def sec_survivors(self, *args: object, **kwargs: object) -> pb.SecSurvivorsReply:
        return self.named

    def sec_unmask(self, request: pb.SecUnmaskRequest) -> None:
        self.sent.append(request)


def test_a_site_keeps_its_unmask_shares_when_the_service_names_fewer_survivors_than_the_quorum() -> None:
    from types import SimpleNamespace

    from fedbroker.worker.secure_task import SecureRun, SecureStepFailed

    task = pb.RoundTask(job_id=JOB, round=ROUND, model_version=1, deadline_unix=time.time() + 60, participants=5)
    run = SecureRun(worker_id="w1", task=task, num_samples=100, ish=None)
    run.crypto = SecAggClient("w1", round_params(5), b"s" * 32, np.random.default_rng(0))
    run.ddp = SimpleNamespace(settings=DIST)  # type: ignore[assignment]  # only its quorum is read here
    client = NamingClient(["w1", "w2", "w3"], ["w4", "w5"])  # three named: the quorum is 4
    with pytest.raises(SecureStepFailed, match="names 3 survivor.*below the round's quorum of 4"):
        run.unmask(client)  # type: ignore[arg-type]
    assert client.sent == [] and not run.unmasked


def test_the_record_reads_back_only_whole_and_the_face_words_it() -> None:
    from fedbroker.app.round_notes import event_words
    from fedbroker.secagg.ddp_record import DDPRecord

    record = DDPRecord(bits=31, scale=2.5e3, wrap_bound=1e-12, quorum=3, noise_multiplier=1.0, clip=1.0,
                       sample_rate=0.2, lr=0.5, dim=650, records=1080, share_variance=2.0e6, total_variance=1.0e7,
                       quorum_variance=6.0e6, variances={"site-1": 6.0e6, "site-2": 2.0e6, "site-3": 2.0e6})
    assert from_stats(record.to_stats()) == record and record.conservative
    stats = record.to_stats()
    del stats["ddp_quorum"]
    with pytest.raises(ValueError, match="ddp_quorum missing"):
        from_stats(stats)
    words = event_words("ddp", 1, record.to_json())
    assert words.startswith("distributed DP: 3 survivor(s), quorum 3") and "site-2 2e+06" in words
    assert event_words("ddp", 1, "not json") == "not json"  # an unreadable record is shown as it is


@pytest.mark.parametrize("quorum", [4, 3])
def test_a_site_takes_the_round_the_service_states_only_when_it_priced_the_same_job(
        book: RoundBook, tmp_path: Path, quorum: int) -> None:
    """Cross-end: the service's SecParams (its session) against a site's own derivation (worker/distributed_step.py);
    a site whose job says another quorum priced another round, and refuses it before masking anything."""
    from dataclasses import replace

    from fedbroker.config import DPPolicy
    from fedbroker.errors import TaskRefused
    from fedbroker.worker.budget import SiteBudget
    from fedbroker.worker.distributed_step import DistributedStep
    from fedbroker.worker.ledger import PrivacyLedger

    open_round(book)
    session = book.table.job(JOB).round.secure  # type: ignore[union-attr]
    assert session is not None
    stated = secure_ddp.sec_params(session, pb.SecParams(length=session.length, ring_bits=session.params.bits))
    policy = DPPolicy(epsilon_budget=1e6, mode="distributed")
    budget = SiteBudget(worker_id="w1", ledger=PrivacyLedger(str(tmp_path / "ledger.json"), worker_id="w1"), dp=policy,
                        num_samples=SAMPLES["w1"])
    step = DistributedStep(job_id=JOB, policy=policy, settings=replace(DIST, quorum=quorum), budget=budget,
                           num_samples=SAMPLES["w1"], rng=np.random.default_rng(0))
    task = pb.RoundTask(job_id=JOB, round=ROUND, model_version=1, participants=len(WORKERS), deadline_unix=4e9)
    step.prepare(task, SPEC)
    if quorum == DIST.quorum:
        assert step.settle(stated, task) == session.params.bits == stated.ddp_bits
    else:
        with pytest.raises(TaskRefused, match="not the one this site priced"):
            step.settle(stated, task)
