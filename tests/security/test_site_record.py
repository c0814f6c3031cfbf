"""The coordinator's SiteRecord call: a site reads its own record (the ε recorded for it, its jobs, what it
shared) with its own token, and nothing more. Another site's record, the scientists' calls (Status, SubmitJob,
CancelJob, JobEvents, DownloadModel) and a scientist's or viewer's SiteRecord are refused, each naming why.
The mutual-TLS leg (a provisioned site's certificate and token) is tests/security/test_identity_binding.py's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from fedbroker.bus import InProcessBus
from fedbroker.config import DPPolicy
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import CoordinatorClient, serve
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import Rejection
from fedbroker.job.status import JobStatus, ParticipantStatus
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import reason_of
from tests.security.conftest import token_table

POLICY = DPPolicy(noise_multiplier=1.1, epsilon_budget=8.0)
IDENTITIES = {"site-a": "worker", "site-b": "worker", "site-new": "worker", "sci": "submitter", "eve": "viewer"}


@dataclass
class Served:
    store: StateStore
    port: int
    tokens: dict[str, str]

    def client(self, identity: str | None) -> CoordinatorClient:
        token = self.tokens[identity] if identity else ""
        return CoordinatorClient(f"127.0.0.1:{self.port}", security=ClientSecurity(token=token), timeout_s=10)


def record_jobs(store: StateStore) -> None:
    """site-a: trained 2 rounds of `sync` (ε rising), refused `refused`, trained an asynchronous job once, aggregated
    (version 1) and once not (round 0), and shared a histogram with `shared-only` before any round. site-b trained
    in `sync` too, at another ε."""
    for worker, epsilon in (("site-a", 3.5), ("site-b", 1.25)):
        store.upsert_worker(worker_id=worker, categories=["digits"], histogram=[1, 2], dp=POLICY,
                            epsilon_spent=epsilon, device="cpu", num_samples=10)
    for job_id in ("sync", "refused", "async", "shared-only", "other"):
        store.add_job(job_id, job_id, "{}", 2, "{}", submitter="sci")
    for r, (ea, eb) in enumerate([(0.5, 0.25), (0.75, 0.5)], start=1):
        store.open_round("sync", r, ["site-a", "site-b"])
        store.close_round("sync", r, model_version=r, aggregated=["site-a", "site-b"],
                          updates=[("site-a", 10, ea, 0.1), ("site-b", 10, eb, 0.1)], accuracy=None, loss=None,
                          seconds=1.0, checkpoint="", stats={}, model_spec_json="{}")
    store.set_job_status("sync", JobStatus.COMPLETED)
    store.open_round("refused", 1, ["site-a"])
    store.record_outcome("refused", 1, "site-a", ParticipantStatus.REFUSED, "privacy budget exceeded")
    store.open_round("async", 1, ["site-a"])
    store.close_round("async", 1, model_version=1, aggregated=["site-a"], updates=[("site-a", 10, 1.0, 0.1)],
                      accuracy=None, loss=None, seconds=1.0, checkpoint="", stats={}, model_spec_json="{}")
    store.record_async_training("async", "site-a", task=2, status=ParticipantStatus.DISCARDED, reason="stale",
                                epsilon=1.5)
    store.note_site_share("shared-only", "site-a", "histogram")
    store.note_site_share("sync", "site-a", "statistics")
    store.note_site_share("sync", "site-a", "histogram")
    store.note_site_share("sync", "site-a", "histogram")  # again: still once
    store.note_site_share("other", "site-b", "evaluation")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    record_jobs(store)
    coordinator = Coordinator(bus=InProcessBus(namespace="site-record"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"))
    table, tokens = token_table(IDENTITIES)
    server, port = serve(coordinator, tokens=table)
    try:
        yield Served(store, port, tokens)
    finally:
        server.stop(grace=0)
        store.close()


def refused(call: object, code: grpc.StatusCode, *fragments: str) -> None:
    assert isinstance(call, grpc.RpcError)
    assert call.code() == code, call.details()
    for fragment in fragments:
        assert fragment in call.details(), call.details()


def test_a_site_reads_its_own_record_jobs_epsilon_rounds_and_shares(served):
    client = served.client("site-a")
    try:
        for asked in ("site-a", ""):  # "" = the caller's own, named by its token
            reply = client.site_record(asked)
            assert reply.worker.worker_id == "site-a" and reply.epsilon_recorded == 3.5
            assert reply.worker.epsilon_budget == 8.0 and reply.worker.epsilon_spent == 3.5
            jobs = {j.job_id: (j.status, j.epsilon, j.rounds, list(j.shared)) for j in reply.jobs}
            assert jobs == {"sync": ("completed", 0.75, 2, ["histogram", "statistics"]),
                            "refused": ("pending", 0.0, 0, []),          # asked, never trained: nothing spent
                            "async": ("pending", 1.5, 1, []),            # the stale training's ε counts, not its round
                            "shared-only": ("pending", 0.0, 0, ["histogram"])}
            assert [j.job_id for j in reply.jobs] == ["sync", "refused", "async", "shared-only"]  # as submitted
    finally:
        client.close()


def test_a_site_asking_for_another_sites_record_is_refused_naming_both(served):
    client = served.client("site-a")
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.site_record("site-b")
    finally:
        client.close()
    refused(info.value, grpc.StatusCode.PERMISSION_DENIED, "'site-a' may read only its own record",
            "'site-b'")
    assert reason_of(info.value) == Rejection.PERMISSION_DENIED


def test_a_site_that_never_registered_gets_not_found_not_someone_elses_record(served):
    client = served.client("site-new")
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.site_record("")
    finally:
        client.close()
    refused(info.value, grpc.StatusCode.NOT_FOUND, "no worker 'site-new' is registered")


@pytest.mark.parametrize("call", ["status", "submit", "cancel", "events", "download"])
def test_a_sites_token_opens_nothing_else_on_the_coordinator(served, call):
    client = served.client("site-a")
    calls = {"status": lambda: client.status(""), "submit": lambda: client.submit(json.dumps({"name": "x"})),
             "cancel": lambda: client.cancel("sync"), "events": lambda: list(client.events("sync")),
             "download": lambda: client.download("sync")}
    try:
        with pytest.raises(grpc.RpcError) as info:
            calls[call]()
    finally:
        client.close()
    refused(info.value, grpc.StatusCode.PERMISSION_DENIED, "'site-a' (role worker) may not call")
    assert served.store.job("sync").status == "completed"  # the cancel did nothing


@pytest.mark.parametrize("who", ["sci", "eve"])
def test_a_scientist_or_viewer_cannot_read_a_sites_record(served, who):
    client = served.client(who)
    try:
        for asked in ("site-a", ""):
            with pytest.raises(grpc.RpcError) as info:
                client.site_record(asked)
            refused(info.value, grpc.StatusCode.PERMISSION_DENIED, f"{who!r}", "may not call SiteRecord",
                    "it is for worker")
        assert client.status("").workers  # what the role is for still works
    finally:
        client.close()


def test_no_token_no_record(served):
    client = served.client(None)
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.site_record("site-a")
    finally:
        client.close()
    refused(info.value, grpc.StatusCode.UNAUTHENTICATED, "needs a bearer token")


def test_without_authentication_a_record_must_name_its_worker(tmp_path):
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    record_jobs(store)
    coordinator = Coordinator(bus=InProcessBus(namespace="site-record-open"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"))
    server, port = serve(coordinator)
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.site_record("")
        refused(info.value, grpc.StatusCode.INVALID_ARGUMENT, "worker_id", "name the worker")
        reply = client.site_record("site-b")
        assert reply.epsilon_recorded == 1.25
        assert [(j.job_id, j.epsilon, j.rounds, list(j.shared)) for j in reply.jobs] == [
            ("sync", 0.5, 2, []), ("other", 0.0, 0, ["evaluation"])]
    finally:
        client.close()
        server.stop(grace=0)
        store.close()


@pytest.mark.parametrize("name", ["", "Histogram", "a,b", "x" * 65, "hist ogram"])
def test_a_share_is_noted_by_a_short_name_only(tmp_path, name):
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    try:
        with pytest.raises(ValueError, match="share's name"):
            store.note_site_share("job", "site-a", name)
    finally:
        store.close()
