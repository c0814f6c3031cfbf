"""An asynchronous job's uploads are weighed by sample counts, so none may claim more than its worker
registered, whenever that worker registered: the attack that set a deployment's global model (a worker that
registered after the job started, its task's `UploadWhole` claiming 10**15 samples of zeros) is refused, and
the service fails closed for a worker whose registered count it does not know."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import envelope
from fedbroker.errors import Rejection
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.worker.agent import WorkerAgent
from tests.aggregators.test_rounds import SPEC, weights
from tests.faults.harness import Federation, job, wait_for
from tests.installed import install

pytestmark = [pytest.mark.integration]

AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}
ASYNC_JOB = job(training={"rounds": 2}, schedule={
    "mode": "async", "buffer_size": 1, "max_staleness": 4, "staleness": "constant", "min_workers": 1})


class TakesTasks(WorkerAgent):
    """A registered worker that trains nothing: it keeps every task it receives (acked) for the test to use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks: list[pb.RoundTask] = []
        self._tasks_lock = threading.Lock()

    def on_task(self, delivery: Any) -> None:
        env = envelope.decode(delivery.body, expect=("round_task", "evaluation_task"))
        if env.HasField("round_task"):  # round tasks only (not federated evaluation's)
            with self._tasks_lock:
                self.tasks.append(env.round_task)
        delivery.ack()


@pytest.fixture
def federation(rabbitmq_url: str, tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(rabbitmq_url, tmp_path)
    try:
        yield fed
    finally:
        fed.close()


@pytest.mark.timeout(120)
def test_a_worker_registered_after_an_async_job_started_cannot_claim_more_samples_than_it_has(
        federation: Federation) -> None:
    fed = federation
    early = fed.add_worker("early", index=0, count=2, agent_class=TakesTasks)
    assert isinstance(early, TakesTasks)
    job_id = fed.submit(ASYNC_JOB)
    wait_for(lambda: early.tasks, 60, "the job's buffer open, a task issued to the worker there at its start")
    late = fed.add_worker("late", index=1, count=2, agent_class=TakesTasks)  # registers after the buffer opened
    assert isinstance(late, TakesTasks)
    task = wait_for(lambda: late.tasks, 60, "a task for the worker that registered late")[0]
    with AggregatorClient(fed.target, timeout_s=10, attempts=1) as client:
        _, _, model = client.download(job_id)
        zeros = {name: np.zeros_like(arr) for name, arr in model.items()}
        with pytest.raises(RemoteError) as refused:
            client.upload(job_id=job_id, round=task.round, worker_id="late", num_samples=10**15, tensors=zeros)
        assert refused.value.reason == Rejection.TOO_MANY_SAMPLES
        assert f"worker 'late' claims {10**15} samples, more than the {len(late.y)} it registered" in str(refused.value)
        assert fed.book.global_model(job_id)[0] == 1  # the global model is untouched
        honest = client.upload(job_id=job_id, round=task.round, worker_id="late", num_samples=len(late.y),
                               tensors=zeros)  # what it registered: the limit is its count, not a refusal of all
        assert not honest.duplicate
    assert fed.book.global_model(job_id)[0] == 2


class Service:
    """The aggregation service alone on a loopback port with a spool, restarted on both by `restart`."""

    def __init__(self, spool: Path) -> None:
        self.spool = spool
        self.book = RoundBook(spool_dir=spool)
        self.server, self.port = serve(self.book)
        self.client = AggregatorClient(f"127.0.0.1:{self.port}", timeout_s=5, attempts=1)
        self.client.put_global("j", 1, SPEC.to_json(), weights(0.0))
        install(self.client, "j", AGG)
        self.client.open_buffer("j", buffer_size=2, max_staleness=4, staleness="constant",
                                staleness_params={}, server_lr=1.0, seed=0, num_samples={"w1": 10})

    def restart(self) -> None:
        self.server.stop(grace=0).wait()
        self.book.stop()
        self.book = RoundBook(spool_dir=self.spool)
        self.server, port = serve(self.book, address=f"127.0.0.1:{self.port}")
        assert port == self.port

    def refusal(self, task: int, worker: str, n: int) -> RemoteError:
        with pytest.raises(RemoteError) as info:
            self.client.upload(job_id="j", round=task, worker_id=worker, num_samples=n, tensors=weights(0.0))
        return info.value


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "spool")
    yield svc
    svc.client.close()
    svc.server.stop(grace=0).wait()
    svc.book.stop()


@pytest.mark.timeout(60)
def test_tasks_carry_each_workers_registered_count_and_the_limit_survives_a_restart(service: Service) -> None:
    c = service.client
    (task,) = c.issue_tasks("j", ["late"], num_samples={"late": 7})  # not known when the buffer opened
    assert service.refusal(task.task, "late", 8).reason == Rejection.TOO_MANY_SAMPLES
    service.restart()
    refused = service.refusal(task.task, "late", 10**15)
    assert refused.reason == Rejection.TOO_MANY_SAMPLES and "more than the 7 it registered" in str(refused)
    # it registered again, with less data: the newest count holds
    (again,) = c.issue_tasks("j", ["late"], num_samples={"late": 3})
    assert service.refusal(again.task, "late", 4).reason == Rejection.TOO_MANY_SAMPLES
    assert not c.upload(job_id="j", round=again.task, worker_id="late", num_samples=3, tensors=weights(1.0)).duplicate


@pytest.mark.timeout(60)
def test_no_task_is_issued_to_a_worker_whose_registered_count_is_not_given(service: Service) -> None:
    with pytest.raises(RemoteError) as info:
        service.client.issue_tasks("j", ["w1", "stranger"])
    assert info.value.reason == Rejection.BAD_REQUEST
    assert "worker 'stranger'" in str(info.value) and "sample count" in str(info.value)
    with pytest.raises(RemoteError) as zero:
        service.client.issue_tasks("j", ["w2"], num_samples={"w2": 0})
    assert zero.value.reason == Rejection.BAD_REQUEST and "worker 'w2'" in str(zero.value)
    assert service.client.buffer_status("j").outstanding == []  # a refused call issues nothing, to anybody


@pytest.mark.timeout(60)
def test_a_task_held_without_a_known_limit_is_refused_naming_the_worker(service: Service) -> None:
    """A spool written before tasks carried limits: a worker holds a task, its count is unknown. Fail closed."""
    (task,) = service.client.issue_tasks("j", ["w1"])  # known from OpenBuffer
    service.server.stop(grace=0).wait()
    (record_path,) = service.spool.rglob("job.json")
    record = json.loads(record_path.read_text())
    record["async"]["num_samples"] = {}
    record_path.write_text(json.dumps(record))
    service.restart()
    refused = service.refusal(task.task, "w1", 1)
    assert refused.reason == Rejection.UNKNOWN_WORKER
    assert "worker 'w1'" in str(refused) and "sample count" in str(refused)
