"""A deployment of `fedbroker` processes for the end-to-end tests: the aggregation service, the coordinator and
workers, each started as a kit starts it (`fedbroker <command>`, its settings in FEDBROKER__* variables), on the
machine's RabbitMQ under a namespace of their own that `close` removes; or (`users=`, a private node) each on its own
broker user as provisioning deploys it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedbroker.bus import delete_topology
from fedbroker.job.status import FINISHED
from tests.rabbitmq_node import PrivateRabbitMQ, free_ports
from tests.source_roots import PYTHONPATH


def stop_all(processes: Sequence[subprocess.Popen[bytes]], *, timeout_s: float = 30.0) -> None:
    """Ask every process to stop at once (so their shutdowns overlap), then kill any still running after
    `timeout_s`."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()


def _clean_env() -> dict[str, str]:
    """This process's environment without its FEDBROKER__ settings, so each process gets only its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env["PYTHONPATH"] = PYTHONPATH
    return env


class Deployment:
    """Processes started with `fedbroker <command>` and their settings in the environment, as a kit does."""

    def __init__(self, url: str, tmp: Path, *, name: str, worker_ids: Sequence[str],
                 users: PrivateRabbitMQ | None = None) -> None:
        """`url`: the administrator's (the test's own look at the broker, and every process's as guest); `users`:
        the node `url` reaches, where the coordinator and each worker get a broker user of their own
        (`<namespace>-<who>`, provisioning's permissions)."""
        self.url, self.tmp, self.worker_ids = url, tmp, list(worker_ids)
        self.namespace = f"fedbroker-{name}-{uuid.uuid4().hex[:8]}"
        # below the kernel's ephemeral range: a service restarted on its port (a restore) finds it free, never taken
        # meanwhile by an outgoing connection or by another listener drawing port 0
        aggregator, coordinator = free_ports(2)
        self.aggregator, self.coordinator = f"127.0.0.1:{aggregator}", f"127.0.0.1:{coordinator}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._client: Any = None
        self.urls = users.provision(namespace=self.namespace, participants=["coordinator", *self.worker_ids]) \
            if users is not None else {}

    def broker_settings(self, command: str, worker_id: str) -> dict[str, Any]:
        """A process's broker login, as its kit holds it: its own user, the coordinator binding each site's control
        messages to that site's user (`worker_broker_users`), a worker training only the coordinator's tasks.
        Nothing as guest."""
        if not self.urls or command not in ("coordinator", "worker"):
            return {}
        if command == "coordinator":
            bound = {f"{self.namespace}-{w}": [w] for w in self.worker_ids}
            return {"broker.url": self.urls["coordinator"], "coordinator.worker_broker_users": json.dumps(bound)}
        return {"broker.url": self.urls[worker_id], "worker.coordinator_broker_user": f"{self.namespace}-coordinator"}

    def spawn(self, name: str, command: str, settings: dict[str, Any], extra_env: dict[str, str] | None = None, *,
              entry: Sequence[str] = ("-m", "fedbroker"), args: Sequence[str] = (), cwd: Path | None = None) -> None:
        """`python ENTRY COMMAND ARGS` (in `cwd`) with `settings` as FEDBROKER__ variables; `entry` names another
        program that takes `fedbroker`'s verbs (a test's own entry point, such as tests/integration/secure_worker.py);
        `args` such as `--config worker.yaml` (the variables override the file)."""
        env = _clean_env()
        base = {"broker.url": self.url, "broker.namespace": self.namespace, "aggregator.target": self.aggregator,
                "coordinator.target": self.coordinator, "log_level": "INFO",
                **self.broker_settings(command, str(settings.get("worker.id", name)))}
        for key, value in {**base, **settings}.items():
            env["FEDBROKER__" + key.upper().replace(".", "__")] = str(value)
        env.update(extra_env or {})
        log = (self.tmp / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen([sys.executable, *entry, command, *args], env=env, stdout=log,
                                                stderr=subprocess.STDOUT, cwd=cwd)

    def cli(self, *args: str, cwd: Path | None = None) -> str:
        """`fedbroker ARGS --coordinator …`'s output (run in `cwd`); a non-zero exit fails the test with both
        streams."""
        done = subprocess.run([sys.executable, "-m", "fedbroker", *args, "--coordinator", self.coordinator],
                              env=_clean_env(), capture_output=True, text=True, timeout=120, cwd=cwd)
        assert done.returncode == 0, f"fedbroker {' '.join(args)}: {done.stdout}\n{done.stderr}"
        return done.stdout

    def coordinator_status(self, job_id: str = "") -> Any:
        """The coordinator's Status reply through this process's own gRPC client (None while it does not answer).
        Wait loops look here first and start a CLI process only once the state they wait for is there: a CLI
        process per poll kept about one of CI's two cores importing the package while the federation trained."""
        import grpc

        from fedbroker.coordinator.service import CoordinatorClient

        if self._client is None:
            self._client = CoordinatorClient(self.coordinator, timeout_s=10)
        try:
            return self._client.status(job_id)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):  # still starting
                # a fresh channel next time, as each CLI process had: a failed one waits out gRPC's reconnect
                # backoff (growing to minutes), which would see a coordinator up only seconds after it is
                self._client.close()
                self._client = None
                return None
            raise  # a refusal (a token, TLS) fails the wait at once rather than hanging it

    def registered(self, count: int) -> bool:
        """At least `count` workers are registered with the coordinator (its own Status, not the CLI's)."""
        reply = self.coordinator_status()
        return reply is not None and len(reply.workers) >= count

    def listed(self, count: int) -> bool:
        """Exactly `count` workers registered, as the coordinator's own Status and then `fedbroker status` show
        them (False while the coordinator is still starting)."""
        try:
            return self.registered(count) and len(json.loads(self.cli("status", "--json"))["workers"]) == count
        except AssertionError:  # the CLI found no coordinator yet
            return False

    def job_ended(self, job_id: str) -> bool:
        """The job is completed, failed or cancelled (its own Status, not the CLI's)."""
        reply = self.coordinator_status(job_id)
        return reply is not None and any(job.status in FINISHED for job in reply.jobs)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def alive(self, *names: str) -> None:
        """The named processes (all when none is named) still run; else the test fails with every log."""
        for name in names or tuple(self.processes):
            process = self.processes[name]
            assert process.poll() is None, f"{name} exited with {process.returncode}\n{self.logs()}"

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str, *, watching: Sequence[str] = ()) -> Any:
        """`predicate`'s first truthy value, polled every 0.3 s while the `watching` processes (all when none is
        named) still run. A hang guard, not a deadline the test relies on: the predicate is a state, not a
        timing; running out fails the test with every log."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.alive(*watching)
            value = predicate()
            if value:
                return value
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def ended_job(self, job_id: str) -> dict[str, Any] | None:
        """`jobs show --json` of a job once it is completed, failed or cancelled (None before): the coordinator's
        own Status first, so a wait loop starts no CLI process per poll."""
        if not self.job_ended(job_id):
            return None
        doc: dict[str, Any] = json.loads(self.cli("jobs", "show", job_id, "--json"))
        return doc if doc["status"] in FINISHED else None

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, remove_topology: bool = True) -> None:
        """Stop the processes and remove the namespace's queues (`remove_topology=False`: a broker thrown away
        after the test keeps them; deleting a quorum queue that lost a member waits on that member)."""
        if self._client is not None:
            self._client.close()
        stop_all(list(self.processes.values()), timeout_s=20)
        if remove_topology:
            delete_topology(self.url, namespace=self.namespace, worker_ids=self.worker_ids)
