"""The coordinator's site-level accounting (privacy.site; store_site_dp): per round the sampled Gaussian at
q = sites asked / sites registered, composed over rounds; recorded per job, idempotent per round, kept across a
restart, and shown by `fedbroker jobs show` as "site-level ε = …, δ = …". On SQLite and on PostgreSQL."""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Any

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from fedbroker.app import jobs
from fedbroker.config import DPPolicy
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_site_dp import SITE_DELTA, account_round
from fedbroker.job.spec import parse_job
from fedbroker.proto import fedbroker_pb2 as pb

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))  # Opacus's accountant's default orders


@functools.lru_cache
def one_round(z: float, asked: int, registered: int) -> np.ndarray:
    return np.asarray(compute_rdp(q=asked / registered, noise_multiplier=z, steps=1, orders=ORDERS))


def recomputed(rounds: list[tuple[float, int, int]], delta: float) -> float:
    """ε of rounds (z, asked, registered), recomputed from the RDP of the sampled Gaussian, one step each."""
    rdp = sum(one_round(*r) for r in rounds)
    return float(get_privacy_spent(orders=ORDERS, rdp=rdp, delta=delta)[0])


class FakeClient:
    def __init__(self, store: StateStore) -> None:
        self.store = store

    def status(self, job_id: str) -> pb.StatusReply:
        reply = pb.StatusReply()
        reply.jobs.add(job_id=job_id, name="dp", status="running", category="c", spec_json="{}")
        return reply

    def events(self, job_id: str, **_: Any) -> list[pb.JobEvent]:
        return [pb.JobEvent(job_id=e.job_id, seq=e.seq, kind=e.kind, round=e.round, message=e.message)
                for e in self.store.events(job_id)]

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_the_recorded_site_level_epsilon_is_the_composed_sampled_gaussian_and_jobs_show_says_it(
        store_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    store = StateStore.from_url(store_url)
    rounds = [(1.1, 3, 10), (1.1, 3, 10), (1.1, 5, 10), (1.1, 10, 10)]  # the last asks every site: q = 1
    for number, (z, asked, registered) in enumerate(rounds, start=1):
        got = store.record_site_dp_round("j", number, asked=asked, registered=registered, noise_multiplier=z)
        assert got.epsilon == pytest.approx(recomputed(rounds[:number], SITE_DELTA), rel=1e-9)
    store.record_site_dp_round("j", 4, asked=10, registered=10, noise_multiplier=1.1)  # a resumed close: again
    store.close()
    again = StateStore.from_url(store_url)  # a restarted coordinator reads what it recorded
    kept = again.site_dp_epsilon("j")
    assert kept is not None and kept.rounds == 4 and kept.delta == SITE_DELTA
    assert kept.epsilon == pytest.approx(recomputed(rounds, SITE_DELTA), rel=1e-9)
    assert again.site_dp_epsilon("other") is None
    monkeypatch.setattr(jobs, "client", lambda args: FakeClient(again))
    assert jobs.cmd_show(argparse.Namespace(job_id="j", json=False)) == 0
    shown = capsys.readouterr().out
    assert f"site-level ε = {kept.epsilon:.4g}, δ = 1e-05 after 4 round(s)" in shown, shown
    assert jobs.cmd_show(argparse.Namespace(job_id="j", json=True)) == 0
    assert json.loads(capsys.readouterr().out)["site_dp"].startswith(f"site-level ε = {kept.epsilon:.4g}")
    # no noise, no guarantee: a clipping-only round makes ε infinite, and says so
    assert math.isinf(again.record_site_dp_round("k", 1, asked=2, registered=2, noise_multiplier=0.0).epsilon)
    again.close()


def test_a_closed_round_is_accounted_at_q_asked_over_the_categorys_registered_sites(any_store: StateStore) -> None:
    store = any_store
    for worker, category in (("a", "c"), ("b", "c"), ("d", "c"), ("e", "c"), ("x", "other")):
        store.upsert_worker(worker_id=worker, categories=[category], histogram=[], dp=DPPolicy(), epsilon_spent=0.0,
                            device="cpu", num_samples=10)
    raw = {"name": "n", "category": "c", "model": {"input_shape": [2], "layers": [
        {"type": "Linear", "in_features": 2, "out_features": 2}]}, "training": {"rounds": 3}}
    site_job = parse_job({**raw, "privacy": {"site": {"noise_multiplier": 1.5}}})
    got = account_round(store, "j", site_job, round_number=1, participants=["a", "b"])
    assert store.site_dp_rounds("j") == [(1, 2, 4, 1.5)]  # q = 2/4: "x" serves another category
    assert got is not None and got.epsilon == pytest.approx(recomputed([(1.5, 2, 4)], SITE_DELTA), rel=1e-9)
    assert account_round(store, "k", parse_job(raw), round_number=1, participants=["a"]) is None
    assert store.site_dp_rounds("k") == [] and not [e for e in store.events("k") if e.kind == "site_dp"]
