"""Benchmark 3b: many connected workers on one aggregation service (asyncio gRPC), with paced heartbeats.

Processes on one machine: the aggregation service (child, `--serve`), `--fleets` stub fleets (children,
`--fleet`), each holding its share of the workers as asyncio stubs, one `grpc.aio` channel — its own TCP
connection — per worker, and this process as the coordinator. Every stub heartbeats (`KeepAlive`) when the
service says to; every round, each stub starts its task (`StartTask`) and uploads a 10-parameter update
(`UploadWhole`), as a worker would on a task from the bus. Rounds are opened for every worker and closed
when all have uploaded (or after `round_timeout_s`), for `--minutes`.

Reported: workers connected, rounds, accepted updates per second, heartbeats per second, the service's
RSS (peak, sampled) and CPU, and the stubs' failures. `make bench` runs the full ten minutes; `--quick` is a
short variant of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = "connected"
IN_FLIGHT = 256     # one fleet process's calls at once
RETRIES = 5
RAMP_PER_S = 500.0  # stubs a fleet brings up per second
MODEL = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]}


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ----- the service ------------------------------------------------------------------------------------


def serve_child(interval_s: float) -> None:
    """The aggregation service with the deployment's limits and heartbeats every `interval_s`."""
    from fedbroker.aggregators.presence import HeartbeatPacing
    from fedbroker.aggregators.round_book import RoundBook
    from fedbroker.aggregators.service import serve

    _raise_fd_limit()
    server, port = serve(RoundBook(), heartbeat=HeartbeatPacing(interval_s=interval_s))
    print(port, flush=True)
    sys.stdin.read()
    server.stop(grace=0)


# ----- a fleet of asyncio stubs -----------------------------------------------------------------------


class Stub:
    """One worker: its own channel, its heartbeats, its uploads."""

    def __init__(self, target: str, worker_id: str, fleet: Fleet) -> None:
        import grpc.aio

        from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
        from fedbroker.rpc.plumbing import CHANNEL_OPTIONS

        # a subchannel of its own: one TCP connection per worker, as 10,000 machines would hold
        self.channel = grpc.aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
        self.aggregation = pb_grpc.AggregationStub(self.channel)
        self.presence = pb_grpc.WorkerPresenceStub(self.channel)
        self.worker_id = worker_id
        self.fleet = fleet

    async def heartbeats(self, delay_s: float) -> None:
        """Heartbeat whenever the service says to, from `delay_s` on (the fleet's stubs start staggered)."""
        from fedbroker.proto import fedbroker_pb2 as pb

        await self.fleet.sleep(delay_s)
        while not self.fleet.stopping:
            request = pb.KeepAliveRequest(worker_id=self.worker_id, state="idle")
            reply = await self.fleet.call(lambda: self.presence.KeepAlive(request, timeout=30),
                                          f"heartbeat {self.worker_id}")
            if reply is not None:
                self.fleet.beats += 1
            await self.fleet.sleep(reply.next_in_ms / 1000 if reply is not None else 5.0)

    async def task(self, round_number: int) -> None:
        """Start the round's task and upload the update, as a worker does on a task from the bus."""
        from fedbroker.proto import fedbroker_pb2 as pb
        from fedbroker.rpc import codec

        start = await self.fleet.call(lambda: self.aggregation.StartTask(pb.StartTaskRequest(
            job_id=JOB, round=round_number, worker_id=self.worker_id, inline_bytes=codec.INLINE_BYTES), timeout=60),
            f"start {self.worker_id}")
        if start is None or start.accepted or not start.open:
            return
        tensors = codec.decode(start.header.tensors, bytearray(start.data))
        update = {name: arr + np.float32(0.01) for name, arr in tensors.items()}
        header = pb.UpdateHeader(job_id=JOB, round=round_number, worker_id=self.worker_id, num_samples=100,
                                 tensors=codec.tensor_specs(update), train_loss=0.5)
        whole = pb.WholeUpdate(header=header, data=codec.joined(update), sha256=codec.tensors_sha256(update))
        if await self.fleet.call(lambda: self.aggregation.UploadWhole(whole, timeout=60),
                                 f"upload {self.worker_id}") is not None:
            self.fleet.uploads += 1


class Fleet:
    """The stubs of one fleet process; rounds announced on stdin ("round N"), "stop" ends it."""

    def __init__(self) -> None:
        self.stopping = False
        self.beats = 0
        self.uploads = 0
        self.failures: list[str] = []
        self.failed = 0
        self.retries = 0
        self.late = 0
        self.inflight = asyncio.Semaphore(IN_FLIGHT)
        self._stop = asyncio.Event()

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(what)

    async def call(self, rpc: Callable[[], Awaitable[Any]], what: str) -> Any:
        """One call, at most IN_FLIGHT of the fleet's at once; retried as a worker retries (UNAVAILABLE, and
        CANCELLED, which the asyncio client reports for some calls it starts in a burst of thousands)."""
        import grpc

        for attempt in range(RETRIES + 1):
            async with self.inflight:
                try:
                    return await rpc()
                except grpc.RpcError as exc:
                    code = exc.code()
                    if code == grpc.StatusCode.FAILED_PRECONDITION and "closed" in (exc.details() or ""):
                        self.late += 1   # the run's time was up: its last round closed with this upload in flight
                        return None
                    if attempt == RETRIES or code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                        self.fail(f"{what}: {code.name}: {exc.details()}")
                        return None
            self.retries += 1
            await self.sleep(random.uniform(0.05, 0.5) * 2 ** attempt)
        return None

    async def sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    async def run(self, target: str, ids: list[str]) -> None:
        stubs = [Stub(target, wid, self) for wid in ids]
        ramp = len(stubs) / RAMP_PER_S   # stubs come up staggered, as a fleet of machines would
        beating = [asyncio.create_task(s.heartbeats(i / RAMP_PER_S)) for i, s in enumerate(stubs)]
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await self.sleep(ramp)
        print("ready", flush=True)
        tasks: list[asyncio.Task[None]] = []
        while line := (await reader.readline()).decode().split():
            if line[0] == "round":
                tasks = [asyncio.create_task(s.task(int(line[1]))) for s in stubs]
            elif line[0] == "stop":
                break
        self.stopping = True
        self._stop.set()
        await asyncio.gather(*beating, *tasks, return_exceptions=True)
        await asyncio.gather(*(s.channel.close() for s in stubs))
        print(json.dumps({"beats": self.beats, "uploads": self.uploads, "failed": self.failed, "retries": self.retries, "late": self.late,
                          "failures": self.failures}), flush=True)


def fleet_child(target: str, first: int, count: int) -> None:
    _raise_fd_limit()
    asyncio.run(Fleet().run(target, [f"w{i:05d}" for i in range(first, first + count)]))


# ----- the run ----------------------------------------------------------------------------------------


def run_connected(workers: int, minutes: float, *, fleets: int = 4, interval_s: float = 30.0,
                  round_timeout_s: float = 120.0) -> dict[str, Any]:
    """Hold `workers` connected stubs on one service for `minutes`, running rounds; the measurements."""
    from bench.streaming import cpu_seconds
    from fedbroker.job.settings import sections_settings
    from fedbroker.job.spec import parse_model
    from fedbroker.rpc.aggregation_client import AggregatorClient

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(os.path.join(REPO, r) for r in
                                                       (".", "coordinator", "worker", "aggregators", "proto"))}
    service = subprocess.Popen([sys.executable, "-m", "bench.connected", "--serve", "--interval", str(interval_s)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    assert service.stdout is not None and service.stdin is not None
    target = f"127.0.0.1:{int(service.stdout.readline())}"
    coordinator = AggregatorClient(target, timeout_s=120)
    ids = [f"w{i:05d}" for i in range(workers)]
    out: dict[str, Any] = {"workers": workers, "rounds": 0, "accepted": 0, "rss_mib": 0.0}
    children: list[subprocess.Popen[str]] = []
    try:
        spec = parse_model(MODEL)
        coordinator.put_global(JOB, 1, spec.to_json(), {"0.weight": np.zeros((2, 4), np.float32),
                                                        "0.bias": np.zeros(2, np.float32)})
        coordinator.install_job(sections_settings(JOB, aggregation={"alignment": "none", "weighting": "fedavg",
                                                                    "selection": "all"}))
        share = -(-workers // fleets)
        children += [subprocess.Popen([sys.executable, "-m", "bench.connected", "--fleet", target, "--first",
                                      str(i * share), "--count", str(min(share, workers - i * share))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
                    for i in range(fleets) if i * share < workers]
        for child in children:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("a stub fleet did not start")
        cpu0, started = cpu_seconds(service.pid), time.monotonic()
        end = started + minutes * 60
        round_number = 0
        while time.monotonic() < end:
            round_number += 1
            coordinator.open_round(JOB, round_number, ids, time.time() + round_timeout_s, seed=round_number)
            for child in children:
                assert child.stdin is not None
                child.stdin.write(f"round {round_number}\n")
                child.stdin.flush()
            deadline = time.monotonic() + round_timeout_s
            while len(coordinator.status(JOB, round_number)[0]) < workers and time.monotonic() < min(deadline, end):
                out["rss_mib"] = max(out["rss_mib"], _rss_mib(service.pid))
                time.sleep(1.0)
            if coordinator.status(JOB, round_number)[0]:
                out["accepted"] += len(coordinator.close_round(JOB, round_number).aggregated)
            else:   # the time was up before any upload of this round came in
                coordinator.abandon_round(JOB, round_number)
            out["rounds"] = round_number
            out["rss_mib"] = max(out["rss_mib"], _rss_mib(service.pid))
        out["seconds"] = time.monotonic() - started
        out["service_cpu_s"] = cpu_seconds(service.pid) - cpu0
    finally:
        coordinator.close()
        reports = []
        for child in children:
            try:
                text, _ = child.communicate("stop\n", timeout=120)
                reports.append(json.loads(text.strip().splitlines()[-1]))
            except Exception as exc:  # a fleet that died: its failure is the report
                child.kill()
                reports.append({"beats": 0, "uploads": 0, "failed": 1, "failures": [repr(exc)]})
        service.communicate("", timeout=60)
    out["heartbeats"] = sum(r["beats"] for r in reports)
    out["failed"] = sum(r["failed"] for r in reports)
    out["retries"] = sum(r.get("retries", 0) for r in reports)
    out["late"] = sum(r.get("late", 0) for r in reports)
    out["failures"] = [f for r in reports for f in r["failures"]][:5]
    return out


def run(*, quick: bool) -> Section:
    """The bench row: 10,000 connected stubs for 10 minutes (quick: 200 for 12 seconds); `python -m bench
    --minutes M` sets the duration."""
    started = time.perf_counter()
    workers = 200 if quick else 10_000
    minutes = float(os.environ.get("FEDBROKER_BENCH_MINUTES") or (0.2 if quick else 10.0))
    section = Section("connected", "3b. Connected workers on one aggregation service",
                      f"{workers} asyncio stub workers (one connection each, 4 fleet processes) on one aggregation "
                      f"service for {minutes:g} min: paced heartbeats (30 s) and rounds of every worker uploading "
                      "10 parameters; the service's peak RSS and CPU.")
    result = run_connected(workers, minutes)
    rate = result["accepted"] / result["seconds"]
    section.rows.append({"workers": workers, "minutes": round(result["seconds"] / 60, 2), "rounds": result["rounds"],
                         "accepted updates / s": Stat.of([rate], "updates/s"),
                         "heartbeats / s": round(result["heartbeats"] / result["seconds"], 1),
                         "service RSS (MiB, peak)": round(result["rss_mib"], 1),
                         "service CPU (%)": round(100 * result["service_cpu_s"] / result["seconds"], 1),
                         "stub failures": result["failed"], "stub retries": result["retries"]})
    if result["failures"]:
        section.notes.append("first stub failures: " + "; ".join(result["failures"]))
    section.goals.append(Goal(f"{workers} connected workers held for {minutes:g} min, failures", result["failed"],
                              "0", result["failed"] == 0 and result["rounds"] > 0))
    section.goals.append(Goal("accepted updates per second with them connected", round(rate, 1),
                              "reported (no target)", None))
    section.seconds = time.perf_counter() - started
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="(child) the aggregation service")
    parser.add_argument("--interval", type=float, default=30.0, help="heartbeat interval, seconds")
    parser.add_argument("--fleet", default="", help="(child) a stub fleet against this target")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--workers", type=int, default=10_000, help="connected stub workers")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to hold them")
    args = parser.parse_args()
    if args.serve:
        serve_child(args.interval)
    elif args.fleet:
        fleet_child(args.fleet, args.first, args.count)
    else:
        print(json.dumps(run_connected(args.workers, args.minutes, interval_s=args.interval), indent=1))


if __name__ == "__main__":
    main()
