"""A host backed up mid-round while everything runs, restored elsewhere: its coordinator resumes the open round
with the update the aggregation service had accepted, and the job completes."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import fedbroker.worker.agent
from fedbroker.app.backup import backup, restore
from fedbroker.app.provision.configs import broker_definitions, broker_user
from fedbroker.app.provision.project import Project
from fedbroker.worker.agent import WorkerAgent
from tests.faults.harness import Federation, HoldsRound, Training, job, wait_for
from tests.integration.processes import Deployment, _clean_env, stop_all
from tests.rabbitmq_node import START_TIMEOUT_S, PrivateRabbitMQ

pytestmark = [pytest.mark.integration]
PASSWORD = "restore-test-password"


@pytest.mark.timeout(240)
def test_a_host_backed_up_mid_round_and_restored_elsewhere_resumes_its_job_to_completion(
        rabbitmq_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", Training())
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    held = HoldsRound.at(2)  # w1 holds its round-2 task; w0 trains and uploads it
    fed = Federation(rabbitmq_url, old)  # its state folder is `old` (coordinator.sqlite, checkpoints/), spool old/spool
    try:
        fed.add_worker("w0", index=0, count=2, agent_class=WorkerAgent)
        fed.add_worker("w1", index=1, count=2, agent_class=held)
        job_id = fed.submit(job(training={"rounds": 3}))
        wait_for(lambda: held.holding == {"w1"} and fed.book.status(job_id, 2) == (["w0"], True), 120,
                 "w0's round-2 update accepted while w1 holds its task")
        backup({"coordinator": str(old), "spool": str(old / "spool"), "ledger": str(old / "w0-ledger.json")},
               str(tmp_path / "host.tar.gz"))  # online: the coordinator, the service and the workers all run
    finally:
        held.release.set()
        fed.close()

    restore(str(tmp_path / "host.tar.gz"), {"coordinator": str(new), "spool": str(new / "spool"),
                                            "ledger": str(new / "w0-ledger.json")})
    training = Training()
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", training)
    fed = Federation(rabbitmq_url, new, start_coordinator=False)
    try:
        assert fed.store.job(job_id).rounds_done == 1 and fed.book.status(job_id, 2) == (["w0"], True)
        assert fed.store.last_checkpoint(job_id).checkpoint.startswith(str(new / "checkpoints"))
        fed.add_worker("w0", index=0, count=2)
        fed.add_worker("w1", index=1, count=2)
        fed.start_coordinator()
        fed.wait_job(job_id, 150)
        assert [r.status for r in fed.store.rounds(job_id)] == ["closed"] * 3
        assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2, 2]
        assert training.count == {"w0": 1, "w1": 2}  # w0's round-2 update came back with the spool
    finally:
        fed.close()


# ----- the documented path, as an operator runs it: real processes, one broker user per participant -----------


class Host:
    """deploy/OPERATING.md's host: the aggregation service and the coordinator as `fedbroker` processes, and two
    sites' workers, each on a private RabbitMQ node with its own broker user and provisioning's permissions
    (`broker_entry`), the coordinator binding each site's control messages to its user."""

    SITES = ("w0", "w1")

    def __init__(self, node: PrivateRabbitMQ, tmp: Path) -> None:
        self.node, self.tmp = node, tmp
        self.d = Deployment(node.url, tmp, name="restore", worker_ids=list(self.SITES))
        project = Project(name=f"p{uuid.uuid4().hex[:6]}", host="127.0.0.1", namespace=self.d.namespace)
        everyone = ("coordinator", *self.SITES)
        self.users = {who: broker_user(project, who) for who in everyone}
        self.urls = {who: f"amqp://{self.users[who]}:{PASSWORD}@127.0.0.1:{node.amqp_port}/%2F" for who in everyone}
        # provisioning's users and permissions in one rabbitmqctl call (six took minutes on a loaded machine)
        node.import_users(broker_definitions(project, {who: PASSWORD for who in everyone}), self.urls)
        self.state, self.spool = tmp / "state", tmp / "spool"

    def start_services(self) -> None:
        """The aggregation service, then the coordinator (OPERATING's order)."""
        self.d.spawn("aggregator", "aggregator", {"aggregator.listen": self.d.aggregator,
                                                  "aggregator.spool_dir": self.spool})
        self.d.spawn("coordinator", "coordinator", {
            "broker.url": self.urls["coordinator"], "coordinator.listen": self.d.coordinator,
            "coordinator.state_dir": self.state, "coordinator.heartbeat_timeout_s": 900,  # a stopped site stays active
            "coordinator.worker_broker_users": json.dumps({self.users[s]: [s] for s in self.SITES})})

    def stop_services(self) -> None:
        stop_all([self.d.processes.pop("coordinator"), self.d.processes.pop("aggregator")], timeout_s=60)

    def start_site(self, index: int) -> None:
        site = self.SITES[index]
        self.d.spawn(site, "worker", {
            "broker.url": self.urls[site], "worker.id": site, "worker.dataset": "digits",
            "worker.partition.num_clients": 2, "worker.partition.client_index": index, "worker.device": "cpu",
            "worker.torch_threads": 1, "worker.heartbeat_s": 1, "worker.ledger_path": self.tmp / f"{site}-ledger.json",
            "worker.coordinator_broker_user": self.users["coordinator"], "worker.dp.noise_multiplier": 1.0,
            "worker.dp.max_grad_norm": 1.0, "worker.dp.epsilon_budget": 1000})

    def fedbroker(self, *args: str) -> str:
        """A documented command, as typed (no --coordinator: backup and restore work on folders)."""
        done = subprocess.run([sys.executable, "-m", "fedbroker", *args], env=_clean_env(), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, f"fedbroker {' '.join(args)}: {done.stdout}\n{done.stderr}"
        return done.stdout

    def registered(self) -> bool:
        try:
            if not self.d.registered(len(self.SITES)):  # the coordinator's own Status first: no CLI process per poll
                return False
            return len(json.loads(self.d.cli("status", "--json"))["workers"]) == len(self.SITES)
        except AssertionError:  # the coordinator is starting
            return False

    def show(self, job_id: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.d.cli("jobs", "show", job_id, "--json"))  # type: ignore[no-any-return]
        except AssertionError:  # the coordinator is starting
            return None

    def stalled(self, job_id: str, *, on: str, uploaded: str, after: int = 0) -> int | None:
        """With site `on` stopped: the open round past `after` that holds `uploaded`'s update and waits for `on`'s
        (`on` holds its task); a round that may still close (`jobs show` read before an upload closed it) is
        ruled out by `after`."""
        log = (self.tmp / f"{uploaded}.log").read_text()
        if not any(int(n) > after for n in re.findall(rf"worker {re.escape(uploaded)} uploaded round (\d+) of {re.escape(job_id)}", log)):
            return None  # no upload past `after` in the log yet: no CLI process for a `jobs show` that cannot match
        doc = self.show(job_id)
        opened = [r["round"] for r in doc["rounds"] if r["status"] == "open"] if doc else []
        return next((n for n in opened if n > after and f"worker {uploaded} uploaded round {n} of {job_id}" in log),
                    None)

    def wait(self, what: str, condition: Any, timeout: float = 300.0) -> Any:
        end = time.monotonic() + timeout  # a hang guard, never a timing the test relies on
        while time.monotonic() < end:
            self.d.alive()
            value = condition()
            if value:
                return value
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}\n{self.d.logs()}")

    def close(self) -> None:
        self.d.close()
        for user in self.users.values():
            self.node.ctl("delete_user", user, timeout=START_TIMEOUT_S)


@pytest.mark.timeout(900)
def test_the_documented_online_backup_and_restore_completes_the_job_that_ran_during_the_backup(
        private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> None:
    """OPERATING's commands exactly: `fedbroker backup` while everything runs; the job goes on past the backup;
    the services stopped, `restore --check`, `restore --force` into the same folders, the services started.
    w0 then holds a task of a round the restored state never reached: the restored aggregation service answers
    that it lies past its state, w0 drops it at once (no retry, nothing dead-lettered), the coordinator's resumed
    round closes and the job completes. (Before: w0 retried the task, and a site's retry through the default
    exchange is refused to its broker user: it never let go of it.)"""
    host = Host(private_rabbitmq, tmp_path)
    try:
        host.start_services()
        host.start_site(0)
        host.start_site(1)
        host.wait("both sites to register", host.registered)
        spec = job(training={"rounds": 8})
        spec["schedule"].update(min_workers=2, quorum=2, wait_for_workers_s=600, round_timeout_s=600)
        (tmp_path / "job.json").write_text(json.dumps(spec))
        host.d.processes["w1"].send_signal(signal.SIGSTOP)  # before the job: its rounds take a blink
        job_id = json.loads(host.d.cli("submit", str(tmp_path / "job.json"), "--json"))["job_id"]
        backup_file = tmp_path / "host.tar.gz"
        w0, w1 = host.d.processes["w0"], host.d.processes["w1"]
        # the job waits on w1 (stopped) in a round w0 uploaded to: the backup is of that round
        backed_up = host.wait("a round waiting for w1", lambda: host.stalled(job_id, on="w1", uploaded="w0"))
        host.fedbroker("backup", "--state", str(host.state), "--spool", str(host.spool), "--out", str(backup_file))
        w0.send_signal(signal.SIGSTOP)
        w1.send_signal(signal.SIGCONT)  # the job goes on past the backup, and waits on w0 in a later round
        held = host.wait("a later round waiting for w0", lambda: host.stalled(job_id, on="w0", uploaded="w1",
                                                                               after=backed_up))
        w1.send_signal(signal.SIGSTOP)  # until w0 has answered: w1 would close the resumed round, and then
        # round `held` would rightly be "not open yet" (retried) rather than past the state
        host.stop_services()
        assert "every digest matches" in host.fedbroker("restore", str(backup_file), "--check")
        host.fedbroker("restore", str(backup_file), "--state", str(host.state), "--spool", str(host.spool), "--force")
        host.start_services()
        w0.send_signal(signal.SIGCONT)  # w0 holds a task of round `held`, past the restored state
        refused = f"worker w0 refused round {held} of {job_id}"
        host.wait("w0 to drop its task", lambda: refused in (tmp_path / "w0.log").read_text())
        w1.send_signal(signal.SIGCONT)

        doc = host.wait("the job to end", lambda: host.d.job_ended(job_id) and (d := host.show(job_id)) and d["status"] in (
            "completed", "failed", "cancelled") and d, timeout=600)
        assert doc["status"] == "completed", (doc["error"], host.d.logs())
        assert [(r["round"], r["status"]) for r in doc["rounds"]] == [(n, "closed") for n in range(1, 9)]
        log = (tmp_path / "w0.log").read_text()  # w0 dropped its task at once: no retry, nothing dead-lettered
        assert f"task {job_id}/{held} on w0 failed" not in log and "dead-lettering" not in log, log
        assert f"worker w0 uploaded round {held} of {job_id}" in log.split(refused)[1]  # the round opened again
    finally:
        host.close()
