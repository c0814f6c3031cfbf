"""An upload whose receipt was lost, retried after its round closed (the next round open, the service restarted
on its spool): it gets its first receipt back, counted once, never `round_closed`; an update that is not the
accepted one stays refused. Against the real gRPC service on loopback, with its spool, as a worker would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.errors import Rejection
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.plumbing import RemoteError
from tests.aggregators.test_rounds import SPEC, weights
from tests.installed import install

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}
LIMITS = {"w1": 10, "w2": 10}


class Service:
    """The aggregation service on a loopback port with a spool; `restart` is a new process on the same both."""

    def __init__(self, spool: Path) -> None:
        self.spool = spool
        self.book = RoundBook(spool_dir=spool)
        self.server, self.port = serve(self.book)
        self.client = AggregatorClient(f"127.0.0.1:{self.port}", timeout_s=5, attempts=1)

    def restart(self) -> None:
        self.server.stop(grace=0).wait()
        self.book.stop()
        self.book = RoundBook(spool_dir=self.spool)
        self.server, port = serve(self.book, address=f"127.0.0.1:{self.port}")
        assert port == self.port

    def upload(self, round_number: int, worker: str, value: float) -> tuple[bool, str, int]:
        receipt = self.client.upload(job_id="j", round=round_number, worker_id=worker, num_samples=10,
                                     tensors=weights(value))
        return receipt.duplicate, receipt.sha256, receipt.bytes_received

    def refusal(self, round_number: int, worker: str, value: float) -> RemoteError:
        with pytest.raises(RemoteError) as info:
            self.upload(round_number, worker, value)
        return info.value

    def close(self) -> None:
        self.client.close()
        self.server.stop(grace=0).wait()
        self.book.stop()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "spool")
    svc.client.put_global("j", 1, SPEC.to_json(), weights(0.0))
    yield svc
    svc.close()


def test_a_sync_upload_retried_after_its_round_closed_gets_its_first_receipt(service: Service) -> None:
    c = service.client
    install(c, "j", AGG)
    c.open_round("j", 1, ["w1", "w2"], 4e9, seed=0, num_samples=LIMITS)
    first = service.upload(1, "w1", 1.0)
    assert not first[0]
    c.close_round("j", 1)
    service.restart()  # the closed round is no longer the job's round in memory: only the spool remembers it
    assert service.upload(1, "w1", 1.0) == (True, first[1], first[2])
    install(c, "j", AGG)
    c.open_round("j", 2, ["w1", "w2"], 4e9, seed=0, num_samples=LIMITS)  # the job moved on
    assert service.upload(1, "w1", 1.0) == (True, first[1], first[2])
    other = service.refusal(1, "w1", 9.0)  # not the update the round took: refused, never a receipt
    assert other.reason == Rejection.ROUND_CLOSED and "round 1 of job 'j'" in str(other)
    assert service.refusal(1, "w2", 1.0).reason == Rejection.ROUND_CLOSED  # never uploaded: too late
    version, _, state = c.download("j")
    assert version == 2
    np.testing.assert_array_equal(state["0.weight"], weights(1.0)["0.weight"])  # counted once, changed nothing


def test_a_retry_while_the_round_closes_is_judged_by_its_digest(service: Service) -> None:
    c = service.client
    install(c, "j", AGG)
    c.open_round("j", 1, ["w1", "w2"], 4e9, seed=0, num_samples=LIMITS)
    first = service.upload(1, "w1", 1.0)
    c.close_round("j", 1)  # still the job's round in memory, now closed
    assert service.upload(1, "w1", 1.0) == (True, first[1], first[2])
    assert service.refusal(1, "w1", 3.0).reason == Rejection.ROUND_CLOSED


def test_an_async_upload_retried_after_the_buffer_closed_gets_its_first_receipt_and_nothing_else(
        service: Service) -> None:
    c = service.client
    install(c, "j", AGG)
    c.open_buffer("j", buffer_size=2, max_staleness=4, staleness="constant", staleness_params={},
                  server_lr=1.0, seed=0, num_samples=LIMITS)
    tasks = {t.worker_id: t.task for t in c.issue_tasks("j", ["w1", "w2"], num_samples=LIMITS)}
    first = service.upload(tasks["w1"], "w1", 1.0)
    c.close_buffer("j")  # the job ended (completed or cancelled) while w1's receipt was on its way
    service.restart()
    assert service.upload(tasks["w1"], "w1", 1.0) == (True, first[1], first[2])
    other = service.refusal(tasks["w1"], "w1", 5.0)
    assert other.reason == Rejection.ROUND_CLOSED and "buffer is closed" in str(other)
    assert service.refusal(tasks["w2"], "w2", 1.0).reason == Rejection.ROUND_CLOSED
    status = c.buffer_status("j")
    assert status.buffered == 1 and status.model_version == 1  # counted once, no version made of it
