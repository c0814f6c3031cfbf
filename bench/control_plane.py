"""Benchmark 3: round control-plane overhead with N trivial workers over the real RabbitMQ.

Three processes on one machine: the aggregation service (child, `bench.streaming --serve`), a fleet of
N stub workers (child, `python -m bench.control_plane --fleet`) and the real `Coordinator` (this
process, SQLite state in a temporary directory). A stub worker is a thread per worker (the bus's
consumer thread): it registers like a worker, heartbeats every 10 s like a worker, and answers each
RoundTask exactly as `WorkerAgent.run_task` does minus the training: on its `AggregatorClient` (one per
worker, kept across tasks), the task's start (round status and the global model, inline), upload of that
model + 0.01 (10 float32 parameters, one message), then the ack. With training at zero, a round's duration is all control plane:
selection, `OpenRound`, publishing N persistent tasks in one transaction, N downloads and uploads, the
wait for the quorum event, `CloseRound`, the checkpoint and the `RoundCompleted` event.

The baseline is Flower's simulation (`flwr.simulation.run_simulation`, Ray backend, FedAvg) of the same
number of trivial clients, run in `.venv-bench`; its first round includes Ray's start and is reported
apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat

DEFAULT_URL = os.environ.get("FEDBROKER_BENCH_AMQP_URL",
                             os.environ.get("FEDBROKER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"))
CATEGORY = "bench"
MODEL = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]}
HEARTBEAT_S = 10.0
SOURCE_ROOTS = (".", "coordinator", "worker", "aggregators", "proto")  # the fedbroker namespace in a checkout
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rabbitmq_reachable(url: str) -> str | None:
    """None when a broker answers at `url`, else why not."""
    try:
        import pika

        params = pika.URLParameters(url)
        params.connection_attempts = 1
        params.socket_timeout = 3
        pika.BlockingConnection(params).close()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


class Fleet:
    """N stub workers sharing one bus (one consumer channel and handler thread each)."""

    def __init__(self, bus: Any, count: int, *, prefix: str = "stub") -> None:
        self.bus = bus
        self.ids = [f"{prefix}{i:04d}" for i in range(count)]
        self.tasks = 0
        self.failures: list[str] = []
        self._channels: dict[str, Any] = {}  # worker id → its AggregatorClient (each touched by its own thread)
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        from fedbroker.bus import envelope
        from fedbroker.proto import fedbroker_pb2 as pb

        for wid in self.ids:
            self.bus.declare_worker(wid)
        for wid in self.ids:
            self.bus.consume_tasks(wid, lambda delivery, wid=wid: self.on_task(wid, delivery))
        self.bus.start()
        for wid in self.ids:
            self.bus.publish_control(envelope.encode(registration=pb.Registration(
                worker_id=wid, categories=[CATEGORY], label_histogram=[10, 10], dp_enabled=False,
                epsilon_spent=0.0, device="cpu", num_samples=100)))
        threading.Thread(target=self._beat, name="fleet-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        """Every worker heartbeats every HEARTBEAT_S, spread evenly over the interval."""
        from fedbroker.bus import envelope
        from fedbroker.proto import fedbroker_pb2 as pb

        gap = HEARTBEAT_S / max(1, len(self.ids))
        while not self._stop.is_set():
            for wid in self.ids:
                if self._stop.wait(gap):
                    return
                try:
                    self.bus.publish_control(envelope.encode(heartbeat=pb.Heartbeat(
                        worker_id=wid, epsilon_spent=0.0, state="idle")))
                except Exception as exc:  # a missed beat is what a real worker would log too
                    self.failures.append(f"heartbeat {wid}: {exc}")

    def on_task(self, wid: str, delivery: Any) -> None:
        from fedbroker.bus import envelope
        from fedbroker.rpc.aggregation_client import AggregatorClient

        try:
            task = envelope.decode(delivery.body, expect=("round_task",)).round_task
            channel = self._channels.get(wid)
            if channel is None:  # as a worker: one channel, kept from task to task
                channel = self._channels[wid] = AggregatorClient(task.aggregator_target)
            client = channel.until(task.deadline_unix)  # as a worker: retried for as long as the round lasts
            start = client.start_task(task.job_id, task.round, wid, task.model_version)
            if start.model is not None:  # open, and without our update
                _, _, weights = start.model
                update = {name: arr + np.float32(0.01) for name, arr in weights.items()}
                client.upload(job_id=task.job_id, round=task.round, worker_id=wid, num_samples=100,
                              tensors=update, train_loss=0.5)
            with self._lock:
                self.tasks += 1
        except Exception as exc:
            with self._lock:
                self.failures.append(f"{wid}: {type(exc).__name__}: {exc}")
        delivery.ack()

    def stop(self) -> None:
        self._stop.set()
        for channel in self._channels.values():
            channel.close()


def fleet_child(url: str, namespace: str, count: int) -> None:
    from fedbroker.bus import open_bus

    bus = open_bus(url, namespace=namespace)
    fleet = Fleet(bus, count)
    fleet.start()
    print("ready", flush=True)
    sys.stdin.read()
    fleet.stop()
    print(json.dumps({"tasks": fleet.tasks, "failures": fleet.failures[:20]}), flush=True)
    bus.close()


def run_ours(count: int, rounds: int, url: str | None, timeout_s: float) -> dict[str, Any]:
    """Rounds of a job with `count` stub workers; per-round seconds from the coordinator's own record."""
    from bench.streaming import _spawn, _stop, cpu_seconds
    from fedbroker.bus import delete_topology, open_bus
    from fedbroker.coordinator.scheduler import Coordinator
    from fedbroker.coordinator.store import StateStore
    from fedbroker.job.spec import parse_job
    from fedbroker.rpc.aggregation_client import AggregatorClient

    namespace = f"fedbroker-bench-{uuid.uuid4().hex[:8]}"
    server, port = _spawn("--serve")
    target = f"127.0.0.1:{port}"
    tmp = tempfile.TemporaryDirectory(prefix="fedbroker-bench-")
    fleet_proc = None
    fleet = None
    store = StateStore(os.path.join(tmp.name, "coordinator.sqlite"))
    bus = open_bus(url, namespace=namespace)
    coordinator = Coordinator(bus=bus, store=store, aggregator=AggregatorClient(target), aggregator_target=target,
                              checkpoint_dir=os.path.join(tmp.name, "checkpoints"))
    setup_started = time.perf_counter()
    try:
        coordinator.start()
        bus.start()
        if url:
            fleet_proc = subprocess.Popen(
                [sys.executable, "-m", "bench.control_plane", "--fleet", str(count), "--namespace", namespace,
                 "--url", url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
            assert fleet_proc.stdout is not None
            if fleet_proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the stub fleet did not start")
        else:
            fleet = Fleet(open_bus(None, namespace=namespace), count)
            fleet.start()
        job = parse_job({
            "name": f"cp{count}", "category": CATEGORY, "seed": 1, "model": MODEL,
            "training": {"rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
            "schedule": {"min_workers": count, "wait_for_workers_s": timeout_s, "round_timeout_s": timeout_s},
            "evaluation": {"every": 0},  # the round's control plane only: the stubs score nothing (as Flower's)
        })
        pids = {"service": server.pid, "coordinator": os.getpid(), "RabbitMQ": _broker_pid() if url else None,
                "stub workers": fleet_proc.pid if fleet_proc else None}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items() if pid}
        job_id = coordinator.submit(job)
        status = coordinator.wait(job_id, timeout=timeout_s)
        cpu_used = {name: cpu_seconds(pids[name]) - before for name, before in cpu_before.items()}
        total = time.perf_counter() - setup_started
        row = store.job(job_id)
        if row is None or status != "completed":
            raise RuntimeError(f"job ended {status}: {row.error if row else '?'}; stub fleet: "
                               f"{_fleet_report(fleet_proc) if fleet_proc else fleet.failures[:5] if fleet else '?'}")
        per_round = [float(r.seconds) for r in store.rounds(job_id)]
        aggregated = [int(r.aggregated) for r in store.rounds(job_id)]
        first_round_started = min(float(r.started) for r in store.rounds(job_id))
        created = float(row.created)
        tasks = max(1, sum(aggregated))
        return {"rounds": per_round, "aggregated": aggregated, "total": total,
                "registration_s": first_round_started - created,
                "cpu_ms_per_task": {name: 1000 * seconds / tasks for name, seconds in cpu_used.items()}}
    finally:
        coordinator.stop()
        if fleet_proc is not None and fleet_proc.poll() is None:
            _fleet_report(fleet_proc)
        if fleet is not None:
            fleet.stop()
            fleet.bus.close()
        bus.close()
        _stop(server)
        store.close()
        if url:
            try:
                delete_topology(url, namespace, [f"stub{i:04d}" for i in range(count)])
            except Exception:
                pass
        tmp.cleanup()


def _broker_pid() -> int | None:
    """The local RabbitMQ node's process (its CPU is part of a round's), when this machine runs one."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if b"beam.smp" in cmdline and b"-s\x00rabbit\x00boot" in cmdline and b"/var/lib/rabbitmq" in cmdline:
                return int(entry)
    return None


def _fleet_report(proc: subprocess.Popen[str]) -> str:
    """Stop the stub fleet; what it printed last (tasks handled, its first failures)."""
    try:
        out, _ = proc.communicate(input="", timeout=30)
        return out.strip().splitlines()[-1] if out.strip() else "no report"
    except Exception as exc:
        proc.kill()
        return f"no report ({type(exc).__name__})"


def publish_times(url: str, count: int, repeats: int) -> dict[str, list[float]]:
    """Seconds to publish `count` persistent tasks, three ways: one confirm wait per task (the bus's
    `publish_task` in a loop, the old round), one AMQP transaction (`publish_tasks`, what a round does
    now), and a confirm channel with every task outstanding (pika's SelectConnection, the third option)."""
    from fedbroker.bus import Topology, delete_topology, open_bus

    namespace = f"fedbroker-bench-pub-{uuid.uuid4().hex[:8]}"
    ids = [f"pub{i:04d}" for i in range(count)]
    bus = open_bus(url, namespace=namespace)
    out: dict[str, list[float]] = {"confirm each": [], "transaction": [], "confirms outstanding": []}
    try:
        for wid in ids:
            bus.declare_worker(wid)
        body = b"x" * 200  # about a RoundTask's size
        for _ in range(repeats):
            started = time.perf_counter()
            for wid in ids:
                bus.publish_task(wid, body)
            out["confirm each"].append(time.perf_counter() - started)
            started = time.perf_counter()
            unroutable = bus.publish_tasks([(wid, body) for wid in ids])
            out["transaction"].append(time.perf_counter() - started)
            assert not unroutable
            out["confirms outstanding"].append(_confirms_outstanding(url, Topology(namespace).tasks_exchange, ids, body))
    finally:
        bus.close()
        try:
            delete_topology(url, namespace, ids)
        except Exception:
            pass
    return out


def _confirms_outstanding(url: str, exchange: str, ids: list[str], body: bytes) -> float:
    """Publish one persistent message per id on a confirm channel without waiting, then wait for every ack."""
    import pika

    state: dict[str, Any] = {"started": 0.0, "seconds": None, "channel": None, "connection": None}
    pending = set(range(1, len(ids) + 1))  # delivery tags not confirmed yet (acks come in any order)
    properties = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)

    def on_confirm(frame: Any) -> None:
        method = frame.method
        if method.multiple:
            pending.difference_update([t for t in pending if t <= method.delivery_tag])
        else:
            pending.discard(method.delivery_tag)
        if not pending and state["seconds"] is None:
            state["seconds"] = time.perf_counter() - state["started"]
            state["connection"].close()

    def on_confirm_mode(_frame: Any) -> None:
        state["started"] = time.perf_counter()
        for wid in ids:
            state["channel"].basic_publish(exchange, wid, body, properties, mandatory=True)

    def on_channel(ch: Any) -> None:
        state["channel"] = ch
        ch.confirm_delivery(on_confirm, callback=on_confirm_mode)

    connection = pika.SelectConnection(
        pika.URLParameters(url), on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_close_callback=lambda *_: state["connection"].ioloop.stop())
    state["connection"] = connection
    connection.ioloop.start()
    if state["seconds"] is None:
        raise RuntimeError(f"{len(pending)} of {len(ids)} confirms did not come back")
    return float(state["seconds"])


def run_flower(count: int, rounds: int, timeout_s: float) -> dict[str, Any] | str:
    """Flower's simulation in .venv-bench: per-round seconds, or why it could not run."""
    from bench.flower_env import bench_python

    python = bench_python()
    if python is None:
        return "no .venv-bench with Flower (run `make bench-env`)"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        try:
            proc = subprocess.run([python, "-m", "bench.flower_sim", str(count), str(rounds), out.name],
                                  cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(os.path.join(REPO, r) for r in SOURCE_ROOTS)}, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"did not finish within {timeout_s:.0f} s"
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return "failed: " + " | ".join(tail)
        with open(out.name) as f:
            return json.load(f)


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "control_plane", "3. Round control-plane overhead",
        "Seconds per round with trivial training (10 parameters, no torch) and N stub workers, and the same per "
        "worker; ours over RabbitMQ with the real coordinator, aggregation service and gRPC client (3 processes), "
        "Flower's Ray simulation of N trivial clients (steady-state rounds 2+; round 1 includes Ray's start).",
    )
    url: str | None = DEFAULT_URL
    why = rabbitmq_reachable(DEFAULT_URL)
    if why is not None:
        section.notes.append(f"RabbitMQ unreachable ({why}): ours ran on the in-process bus instead.")
        url = None
    plan = [(10, 2)] if quick else [(10, 5), (100, 4), (1000, 3)]
    for count, rounds in plan:
        timeout = 120.0 if quick else 420.0
        try:
            ours = run_ours(count, rounds, url, timeout)
        except Exception as exc:
            section.notes.append(f"N={count}: ours failed: {type(exc).__name__}: {exc}")
            continue
        per_round = Stat.of(ours["rounds"], "s")
        section.rows.append({
            "N workers": count, "system": "fedbroker (RabbitMQ)" if url else "fedbroker (in-process bus)",
            "rounds": rounds, "s / round": per_round, "ms / round / worker": per_round.scaled(1000 / count, "ms"),
            "first round / startup (s)": round(ours["registration_s"], 2),
            "aggregated per round": min(ours["aggregated"]),
        })
        if quick:
            continue
        flower = run_flower(count, rounds, timeout_s=600.0)
        if isinstance(flower, str):
            section.notes.append(f"N={count}: Flower simulation: {flower}")
            continue
        steady = Stat.of(flower["rounds"][1:] or flower["rounds"], "s")
        section.rows.append({
            "N workers": count, "system": f"Flower {flower['version']} simulation (Ray)", "rounds": rounds,
            "s / round": steady, "ms / round / worker": steady.scaled(1000 / count, "ms"),
            "first round / startup (s)": round(flower["rounds"][0], 2), "aggregated per round": min(flower["results"]),
        })
    if quick:
        section.notes.append("Quick mode: N = 10 only, no Flower simulation (Ray's start alone takes ~15 s).")
    for row in (r for r in section.rows if r["system"].startswith("fedbroker")):
        budget = 20 + 2 * row["N workers"]
        ms = row["s / round"].median * 1000
        section.goals.append(Goal(f"N={row['N workers']}: ms per synchronous round", round(ms, 1),
                                  f"<= {budget} ms (20 + 2/worker)", ms <= budget))
    if url and not quick:
        publish = publish_times(url, 1000, repeats=3)
        for method, times in publish.items():
            section.notes.append(f"publishing 1000 persistent tasks, {method}: "
                                 f"{Stat.of(times, 's').median * 1000:.0f} ms (median of {len(times)})")
        batch = Stat.of(publish["transaction"], "s").median
        section.goals.append(Goal("publish 1000 persistent tasks (s), one transaction", round(batch, 3), "< 0.1",
                                  batch < 0.1))
    ours_rows = [r for r in section.rows if r["system"].startswith("fedbroker")]
    for row in ours_rows:
        theirs = [r for r in section.rows if r["N workers"] == row["N workers"] and r is not row]
        row["× Flower"] = round(theirs[0]["s / round"].median / row["s / round"].median, 2) if theirs else None
        if theirs:
            section.goals.append(Goal(f"N={row['N workers']}: round throughput vs Flower's simulation (×)",
                                      row["× Flower"], "reported (no target)", None))
    if ours_rows:
        worst = max(ours_rows, key=lambda r: r["ms / round / worker"].median)
        section.goals.append(Goal("control-plane cost per worker per round (ms), worst N",
                                  round(worst["ms / round / worker"].median, 2), "reported (no target)", None,
                                  f"N={worst['N workers']}"))
    section.seconds = time.perf_counter() - started
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=int, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--url", required=True)
    args = parser.parse_args()
    fleet_child(args.url, args.namespace, args.fleet)


if __name__ == "__main__":
    main()
