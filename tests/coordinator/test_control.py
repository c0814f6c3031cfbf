"""Publishing a task to a worker with no task queue (issue 12, item 4), on the in-process bus: an accepted
registration declares the worker's queue, and a task that is still unroutable is not retried as if the
broker were down; its worker is a straggler at once, and the tasks after it go out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from fedbroker.bus import InProcessBus, envelope
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient

pytestmark = pytest.mark.timeout(60)


class CountingBus(InProcessBus):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.published: list[str] = []

    def publish_tasks(self, tasks: Sequence[tuple[str, bytes]]) -> list[str]:
        self.published.append(",".join(w for w, _ in tasks))
        return super().publish_tasks(tasks)


def coordinator(tmp_path: Path, bus: InProcessBus) -> Coordinator:
    return Coordinator(bus=bus, store=StateStore(str(tmp_path / "coordinator.sqlite")),
                       aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                       checkpoint_dir=str(tmp_path / "ck"), poll_interval_s=0.02)


def test_an_unroutable_task_is_not_retried_until_the_deadline(tmp_path: Path) -> None:
    bus = CountingBus(namespace="control-test")
    c = coordinator(tmp_path, bus)
    bus.declare_worker("w1")
    try:
        sent = c.context.publish_tasks([(w, b"task") for w in ("ghost", "w1")], time.time() + 3600)
    finally:
        bus.close()
    assert sent == {"w1"}
    assert bus.published == ["ghost,w1"]  # one batch, one try: the ghost is a straggler at once


def test_an_accepted_registration_declares_the_workers_task_queue(tmp_path: Path) -> None:
    bus = InProcessBus(namespace="control-test")
    c = coordinator(tmp_path, bus)
    c.start()
    bus.start()
    try:
        bus.publish_control(envelope.encode(registration=pb.Registration(
            worker_id="ghost", categories=["digits"], num_samples=10, device="cpu")))
        deadline = time.monotonic() + 30
        while not any(w.worker_id == "ghost" for w in c.store.workers()):
            assert time.monotonic() < deadline, "the registration was not stored"
            time.sleep(0.02)
        bus.publish_task("ghost", b"task")  # routable: the task waits in the ghost's queue
    finally:
        c.stop()
        bus.close()
