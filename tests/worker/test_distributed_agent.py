"""The worker agent in distributed-DP jobs, without a network: it registers its dp.mode and floor, a site with DP
off refuses the job's tasks before any call to the service, and a failed round reports both figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedbroker.bus import envelope, open_bus
from fedbroker.config import DPPolicy, WorkerConfig
from fedbroker.errors import TaskRefused
from fedbroker.job.settings import sections_settings, settings_digest
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent
from fedbroker.worker.training import TrainResult


def agent(tmp_path: Path, dp: DPPolicy) -> tuple[WorkerAgent, list[Any]]:
    config = WorkerConfig(id="owner", ledger_path=str(tmp_path / "ledger.json"), device="cpu", dp=dp)
    sent: list[Any] = []
    bus = open_bus(None, namespace=f"ddp-{tmp_path.name}")
    bus.publish_control = lambda body: sent.append(  # type: ignore[method-assign]
        envelope.decode(body, expect=("registration", "heartbeat", "task_outcome")))
    return WorkerAgent(config, bus), sent


def distributed_task() -> pb.RoundTask:
    message = sections_settings("ddp-job", aggregation={"secure": True})
    message.privacy.distributed.CopyFrom(pb.DistributedDPSettings(enabled=True, noise_multiplier=1.0, clip=1.0,
                                                                  sample_rate=0.05, quorum=2))
    return pb.RoundTask(job_id="ddp-job", round=1, category="digits", participants=3, deadline_unix=4e9,
                        aggregator_target="unreachable:1", settings_digest=settings_digest(message),
                        settings=message)


def test_the_registration_carries_the_sites_mode_and_floor(tmp_path: Path) -> None:
    worker, sent = agent(tmp_path, DPPolicy(mode="distributed", local_floor_epsilon=4.0))
    worker.register()
    policy = sent[-1].registration.dp_policy
    assert (policy.mode, policy.local_floor_epsilon, policy.noise_multiplier) == ("distributed", 4.0, 1.0)


def test_a_site_with_dp_off_refuses_a_distributed_dp_task_before_calling_the_service(tmp_path: Path) -> None:
    worker, _ = agent(tmp_path, DPPolicy(enabled=False))
    worker._aggregator = lambda target: pytest.fail("no call to the service")  # type: ignore[method-assign]
    with pytest.raises(TaskRefused, match=r"worker.dp.enabled: false"):
        worker.run_task(distributed_task())
    assert worker.ledger.total_epsilon() == 0.0


def test_a_failed_distributed_round_reports_both_figures(tmp_path: Path) -> None:
    worker, sent = agent(tmp_path, DPPolicy(mode="distributed"))
    spent = TrainResult(state={}, num_samples=10, train_loss=0.0, steps=1, seconds=0.1, samples_per_second=1.0,
                        epsilon=0.8, history=[], epsilon_local_floor=3.5)
    worker._report(distributed_task(), pb.TaskOutcome.FAILED, "the upload was refused", spent=spent)
    outcome = sent[-1].task_outcome
    assert (outcome.epsilon, outcome.epsilon_local_floor) == (0.8, 3.5)
