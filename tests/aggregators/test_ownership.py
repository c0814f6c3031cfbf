"""Aggregation replicas in one process: two RoundBooks on one shared spool folder and one lease database (SQLite
here; the chaos case tests/ha/test_aggregation_failover.py runs real processes). A job is served by the replica
holding its lease; a dead owner's job moves with everything it acknowledged; a replica that lost a job writes
nothing; what a dishonest site, a forged redirect or a full shared volume can do (deploy/SECURITY.md)."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY
from sqlalchemy import update

from fedbroker.aggregators import spool as spool_module
from fedbroker.aggregators.ownership import JobOwnership, NotOwner, lease_engine
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.aggregators.spool import job_folder
from fedbroker.errors import ConfigError, Rejection, UnknownJob, UploadRejected
from fedbroker.ha.lease import LEASES, Lease, LeaseLost
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity, generate_token
from tests.aggregators.test_rounds import AGG, SPEC, stream, weights
from tests.faults.harness import wait_for
from tests.postgres_node import scratch_database
from tests.rabbitmq_node import free_ports

pytestmark = pytest.mark.timeout(60)
WORKERS = ["w1", "w2", "w3"]


def replica(tmp_path: Path, name: str, database_url: str = "") -> RoundBook:
    """A replica advertised as `name`, on the shared spool under `tmp_path` and the lease database (default: a
    SQLite file beside the spool)."""
    engine = lease_engine(database_url or f"sqlite:///{tmp_path / 'leases.sqlite'}")
    return RoundBook(spool_dir=tmp_path / "spool", ownership=JobOwnership(engine, advertise=name, ttl_s=30.0))


def opened(book: RoundBook, job: str = "j") -> RoundBook:
    book.put_global(job, 1, SPEC.to_json(), weights(0.0))
    book.open_round(job, 1, WORKERS, deadline=4e9, aggregation=AGG, seed=5)
    return book


def dies(book: RoundBook, job: str = "j") -> None:
    """The replica stops renewing (as a kill -9 would: nothing released) and its lease lapses."""
    ownership = book.table.ownership
    assert ownership is not None
    for keeper in list(ownership._keepers.values()):
        keeper.stop()
    with ownership.engine.begin() as conn:
        conn.execute(update(LEASES).where(LEASES.c.name == f"job:{job}").values(expires=0.0))


def upload(book: RoundBook, worker: str, value: float, n: int = 10) -> bool:
    return book.receive_update(stream(weights(value), worker=worker, n=n)).duplicate


def owned() -> float:
    return REGISTRY.get_sample_value("fedbroker_aggregation_jobs_owned") or 0.0


@pytest.fixture(params=["sqlite", "postgresql"])
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RoundBook, RoundBook]]:
    """Two replicas on one lease database: a SQLite file (replicas on one machine), or PostgreSQL (a database of
    the test's own on the machine's server, where the fence holds a row lock)."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_database()) if request.param == "postgresql" else ""
        a, b = replica(tmp_path, "a:1", url), replica(tmp_path, "b:2", url)
        for book in (a, b):  # before the database is dropped
            assert book.table.ownership is not None
            stack.callback(book.table.ownership.engine.dispose)
        try:
            yield a, b
        finally:
            a.stop()
            b.stop()


def test_a_job_is_served_by_one_replica_and_the_other_names_it(replicas: tuple[RoundBook, RoundBook]) -> None:
    a, b = replicas
    before = owned()
    opened(a)
    assert owned() == before + 1
    with pytest.raises(NotOwner) as refused:
        b.status("j", 1)
    assert refused.value.owner == "a:1" and refused.value.reason == "not_owner"
    with pytest.raises(NotOwner):
        upload(b, "w1", 1.0)  # nothing read, nothing spooled by the replica that does not own the job
    assert a.status("j", 1) == ([], True)


def test_a_takeover_keeps_every_acknowledged_update_and_a_resent_one_counts_once(
        replicas: tuple[RoundBook, RoundBook]) -> None:
    a, b = replicas
    opened(a)
    assert not upload(a, "w1", 1.0, 10)
    assert not upload(a, "w2", 4.0, 30)
    dies(a)
    assert b.status("j", 1) == (["w1", "w2"], True)  # taken over on demand, from the shared spool
    assert upload(b, "w2", 4.0, 30)  # a worker whose receipt was lost re-sends the same update: a duplicate
    assert not upload(b, "w3", 2.0, 20)
    result = b.close("j", 1)
    assert [u.worker_id for u in result.updates] == WORKERS  # 0 lost, 0 counted twice

    alone = opened(RoundBook())
    for worker, value, n in (("w1", 1.0, 10), ("w2", 4.0, 30), ("w3", 2.0, 20)):
        upload(alone, worker, value, n)
    expected = alone.close("j", 1)
    assert (result.model_version, result.updates) == (expected.model_version, expected.updates)
    for name, array in alone.global_model("j")[2].items():
        np.testing.assert_array_equal(b.global_model("j")[2][name], array)


def test_a_replica_that_lost_its_lease_writes_nothing_and_then_names_the_owner(
        replicas: tuple[RoundBook, RoundBook], tmp_path: Path) -> None:
    a, b = replicas
    opened(a)
    upload(a, "w1", 1.0)
    dies(a)  # paused past its lease: it still believes it owns the job
    assert b.status("j", 1) == (["w1"], True)
    round_folder = job_folder(tmp_path / "spool", "j") / "round-1"
    files = sorted(p.name for p in round_folder.iterdir())
    with pytest.raises(LeaseLost):
        upload(a, "w2", 4.0)  # fenced: refused before anything is written
    assert sorted(p.name for p in round_folder.iterdir()) == files
    wait_for(lambda: "j" not in a.table.jobs, 10, "the old owner to forget the job")
    with pytest.raises(NotOwner) as refused:
        a.status("j", 1)
    assert refused.value.owner == "b:2"


def test_a_site_naming_a_job_nobody_installed_takes_no_lease(replicas: tuple[RoundBook, RoundBook],
                                                              tmp_path: Path) -> None:
    _, b = replicas
    with pytest.raises((UploadRejected, UnknownJob)) as refused:
        b.receive_update(stream(weights(1.0), job="not-a-job"))
    assert refused.value.reason == Rejection.UNKNOWN_JOB
    assert b.table.ownership is not None
    assert Lease(b.table.ownership.engine, "job:not-a-job", "test").holder_now() is None


def test_a_full_shared_volume_refuses_the_upload_unacknowledged_and_the_job_stays_owned(
        replicas: tuple[RoundBook, RoundBook], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = replicas
    opened(a)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_module, "_write_npz", full)
    with pytest.raises(UploadRejected) as refused:
        upload(a, "w1", 1.0)
    assert refused.value.reason == Rejection.SPOOL_FULL  # UNAVAILABLE: the worker retries, nothing was counted
    monkeypatch.undo()
    assert a.status("j", 1) == ([], True)
    with pytest.raises(NotOwner):
        b.status("j", 1)
    assert not upload(a, "w1", 1.0)


def test_a_secure_round_fails_by_name_when_its_owner_dies(replicas: tuple[RoundBook, RoundBook]) -> None:
    a, b = replicas
    a.put_global("s", 1, SPEC.to_json(), weights(0.0))
    a.open_round("s", 1, WORKERS, 4e9, {"secure": True}, seed=3, num_samples=dict.fromkeys(WORKERS, 10))
    dies(a, "s")
    with pytest.raises(UploadRejected, match="restarted during secure round 1") as refused:
        b.secure.advertise(pb.SecAdvertiseRequest(job_id="s", round=1, worker_id="w1", num_samples=5,
                                                  cipher_key=bytes(32), mask_key=bytes(32)))
    assert refused.value.reason == Rejection.SECURE_PROTOCOL  # final: the coordinator re-opens the round


class ForgedRedirect(pb_grpc.AggregationServicer):
    """Not a replica: answers every status call with a `not_owner` refusal naming an address of its choosing."""

    def RoundStatus(self, request: pb.RoundStatusRequest, context: grpc.ServicerContext) -> pb.RoundStatusReply:
        context.set_trailing_metadata((("fedbroker-reason", "not_owner"), ("fedbroker-owner", "127.0.0.1:9")))
        context.abort(grpc.StatusCode.UNAVAILABLE, "job j is served by 127.0.0.1:9")
        raise AssertionError("unreachable")


def test_a_client_follows_not_owner_only_to_its_own_targets(tmp_path: Path) -> None:
    forged = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AggregationServicer_to_server(ForgedRedirect(), forged)
    forged_port = forged.add_insecure_port("127.0.0.1:0")
    forged.start()
    book = opened(RoundBook())
    server, port = serve(book)
    client = AggregatorClient(f"127.0.0.1:{forged_port},127.0.0.1:{port}", attempts=3)
    try:
        assert client.status("j", 1) == ([], True)  # the forged owner was never called: the next target was
        assert "127.0.0.1:9" not in client._replicas.targets
        assert client._replicas.targets[client._replicas._index] == f"127.0.0.1:{port}"
    finally:
        client.close()
        server.stop(grace=0)
        forged.stop(grace=0)
        book.stop()


def test_a_client_goes_straight_to_the_owner_a_replica_names(tmp_path: Path) -> None:
    (a_port,) = free_ports(1)
    a, b = replica(tmp_path, f"127.0.0.1:{a_port}"), replica(tmp_path, "127.0.0.1:1")
    a_server, _ = serve(a, address=f"127.0.0.1:{a_port}")
    b_server, b_port = serve(b)
    client = AggregatorClient(f"127.0.0.1:{b_port},127.0.0.1:{a_port}", attempts=1)  # b first: not the owner
    try:
        opened(a)
        assert client.status("j", 1) == ([], True)  # one try: the redirect was followed within it
    finally:
        client.close()
        a_server.stop(grace=0)
        b_server.stop(grace=0)
        a.stop()
        b.stop()


def test_a_token_goes_only_to_the_replicas_the_process_lists() -> None:
    security = ClientSecurity(token=generate_token(), expected_target="a.example:1,b.example:2")
    AggregatorClient("b.example:2,a.example:1", security=security).close()  # a task may list them in any order
    with pytest.raises(ConfigError, match="refusing to send"):  # a forged task naming one more "replica"
        AggregatorClient("a.example:1,evil.example:3", security=security)
