"""A job's whole life cycle against the real coordinator gRPC server, RabbitMQ and a real federation:
list, show, logs --follow, cancel, download; who may do what; unknown ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import yaml

from fedbroker.app.cli import main
from fedbroker.bus import open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.checkpoints import checkpoints_of, load_checkpoint
from fedbroker.coordinator.service import CoordinatorClient, serve
from fedbroker.job.spec import parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.worker.agent import WorkerAgent
from tests.integration.conftest import Federation
from tests.security.conftest import token_table
from tests.source_roots import PYTHONPATH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = {
    "name": "life",
    "category": "digits",
    "seed": 3,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": 2, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
    "schedule": {"min_workers": 1, "wait_for_workers_s": 60, "round_timeout_s": 240},
    "evaluation": {"dataset": "digits"},
}


def until(condition, *, what: str, within_s: float = 120.0):
    """Wait on a condition (never on a clock reading): generous, for a loaded 2-core CI machine."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Served:
    """A federation whose coordinator is served over gRPC with a token table: alice and bob submit, carol views."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.fed = Federation(url, tmp)
        self.tmp = tmp
        table, self.tokens = token_table({"alice": "submitter", "bob": "submitter", "carol": "viewer"})
        self.server, port = serve(self.fed.coordinator, tokens=table)
        self.target = f"127.0.0.1:{port}"

    def client(self, who: str) -> CoordinatorClient:
        return CoordinatorClient(self.target, security=ClientSecurity(token=self.tokens[who]))

    def config(self, who: str) -> str:
        """A CLI config file holding `who`'s token and the coordinator's address."""
        path = self.tmp / f"{who}.yaml"
        path.write_text(yaml.safe_dump({"client": {"token": self.tokens[who]}, "coordinator": {"target": self.target}}))
        return str(path)

    def worker(self, worker_id: str, *, categories: tuple[str, ...] = ("digits",), index: int = 0,
               count: int = 1, dp: DPPolicy | None = None) -> WorkerAgent:
        bus = open_bus(self.fed.url, namespace=self.fed.namespace)
        agent = WorkerAgent(WorkerConfig(
            id=worker_id, categories=categories,
            partition=PartitionSection(scheme="iid", num_clients=count, client_index=index),
            dp=dp or DPPolicy(enabled=False), ledger_path=str(self.tmp / f"{worker_id}-ledger.json"), device="cpu",
            heartbeat_s=1.0), bus)
        agent.start()
        bus.start()
        self.fed.workers[worker_id] = agent
        return agent

    def close(self) -> None:
        self.server.stop(grace=0)
        self.fed.close()


@pytest.fixture
def served(rabbitmq_url, tmp_path):
    s = Served(rabbitmq_url, tmp_path)
    yield s
    s.close()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def submit(served: Served, who: str, job: dict) -> str:
    c = served.client(who)
    try:
        return c.submit(json.dumps(job))
    finally:
        c.close()


def test_cancel_mid_round_abandons_it_and_the_workers_go_on_serving_other_jobs(served, capsys):
    """Round 1 holds w0's upload and waits for w1 (stopped): a cancel then abandons the round at the
    aggregation service (no version 2, no checkpoint), records w0's upload as discarded, and w0 goes on to
    run another job to its end."""
    policy = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
    w0 = served.worker("w0", categories=("digits", "other"), index=0, count=2, dp=policy)
    w1 = served.worker("w1", index=1, count=2)
    until(lambda: len(served.fed.store.workers("digits")) == 2, what="both workers registered")
    w1.stop()  # still counted active for a while: selected, it never trains, so the round stays open
    w1.bus.close()
    job = dict(JOB, schedule=dict(JOB["schedule"], min_workers=2))
    job_id = submit(served, "alice", job)
    until(lambda: [p.status for p in served.fed.store.participants(job_id, 1) if p.worker_id == "w0"]
          == ["uploaded"], what="w0 upload in round 1")

    code, out, err = cli(capsys, "jobs", "cancel", job_id, "--config", served.config("alice"))
    assert code == 0 and f"job {job_id} cancelled" in out, (out, err)

    store = served.fed.store
    assert store.job(job_id).status == "cancelled" and store.job(job_id).rounds_done == 0
    assert store.job(job_id).error == "cancelled by alice"
    (rnd,) = store.rounds(job_id)
    assert rnd.status == "abandoned" and rnd.model_version is None and rnd.checkpoint is None
    assert checkpoints_of(served.tmp / "checkpoints", job_id) == []
    assert served.fed.book.global_model(job_id)[0] == 1  # no version came of the round
    assert served.fed.book.status(job_id, 1)[1] is False  # and it is closed to uploads
    rows = {p.worker_id: p for p in store.participants(job_id, 1)}
    assert rows["w0"].status == "discarded" and rows["w0"].num_samples > 0
    # the ε w0's ledger charged for the discarded update is on the job's record too
    assert rows["w0"].epsilon == pytest.approx(w0.ledger.epsilon(job_id), rel=1e-9) and rows["w0"].epsilon > 0
    assert rows["w1"].status == "cancelled" and rows["w1"].epsilon is None

    code, out, _ = cli(capsys, "jobs", "logs", job_id, "--json", "--config", served.config("carol"))
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert code == 0 and kinds[-2:] == ["round_abandoned", "cancelled"], kinds
    assert "round_closed" not in kinds

    # a second cancel of the finished job is refused, naming why
    code, _, err = cli(capsys, "jobs", "cancel", job_id, "--config", served.config("alice"))
    assert code == 1 and "FAILED_PRECONDITION" in err and "already cancelled" in err

    other = dict(JOB, name="after", category="other")
    other["training"] = dict(JOB["training"], rounds=1)
    other_id = submit(served, "bob", other)
    assert served.fed.coordinator.wait(other_id, timeout=240) == "completed", store.job(other_id).error
    assert [p.status for p in store.participants(other_id)] == ["aggregated"]
    assert set(w0.ledger.jobs()) == {job_id, other_id}  # it trained the next job as usual


def test_only_the_submitter_may_cancel_or_download_and_unknown_ids_exit_nonzero(served, capsys):
    served.worker("w0")
    job = dict(JOB, training=dict(JOB["training"], rounds=1))
    job_id = submit(served, "alice", job)
    assert served.fed.coordinator.wait(job_id, timeout=240) == "completed"

    for who, code_name in (("bob", "PERMISSION_DENIED"), ("carol", "PERMISSION_DENIED")):
        c = served.client(who)
        with pytest.raises(grpc.RpcError) as refused:
            c.cancel(job_id)
        assert refused.value.code().name == code_name
        with pytest.raises(grpc.RpcError) as refused:
            c.download(job_id)
        assert refused.value.code().name == code_name
        c.close()
    code, _, err = cli(capsys, "jobs", "download", job_id, "--out", str(served.tmp / "bob"),
                       "--config", served.config("bob"))
    assert code == 1 and "only the identity that submitted" in err and not (served.tmp / "bob").exists()

    # a viewer reads: list, show, logs
    code, out, _ = cli(capsys, "jobs", "list", "--json", "--config", served.config("carol"))
    (row,) = json.loads(out)
    assert code == 0 and row["job_id"] == job_id and row["submitter"] == "alice" and row["status"] == "completed"
    assert row["spec"]["name"] == "life"
    code, out, _ = cli(capsys, "jobs", "show", job_id, "--json", "--config", served.config("carol"))
    shown = json.loads(out)
    assert code == 0 and [r["status"] for r in shown["rounds"]] == ["closed"]
    code, out, _ = cli(capsys, "jobs", "show", job_id, "--config", served.config("carol"))
    assert code == 0 and re.search(r"^submitter +alice$", out, re.M) and "ROUNDS" in out
    # the settings the job runs with, and the workers it asked (not an empty table)
    model = re.search(r"^model +input \[1, 8, 8\]: (.*)$", out, re.M)
    assert model and [layer.split("(")[0] for layer in model[1].split(" → ")] == ["Flatten", "Linear", "ReLU", "Linear"]
    assert "in_features=64" in model[1] and "out_features=10" in model[1]
    assert re.search(r"^training +batch_size 32, local_epochs 1, lr 0.1, .*rounds 1$", out, re.M)
    assert re.search(r"^schedule .*min_workers 1, mode sync", out, re.M)
    assert re.search(r"^aggregation +alignment none, selection all, weighting fedavg$", out, re.M)
    assert re.search(r"^evaluation +dataset digits", out, re.M)
    workers = out.split("WORKERS (this job)")[1].strip().splitlines()
    assert len(workers) == 3 and workers[2].split()[:3] == ["w0", "1", "0"], out

    # every --json output has the same shapes: a spec object, numbers as numbers, one key order
    code, out, _ = cli(capsys, "status", "--job", job_id, "--json", "--config", served.config("carol"))
    status = json.loads(out)
    assert code == 0 and status["jobs"][0]["spec"] == shown["spec"] == row["spec"]
    assert "spec_json" not in status["jobs"][0] and list(status["jobs"][0]) == list(row) == list(shown)[:len(row)]
    assert status["participants"] == shown["participants"]
    assert isinstance(shown["participants"][0]["num_samples"], int) and shown["participants"][0]["num_samples"] > 0
    code, out, _ = cli(capsys, "jobs", "logs", job_id, "--json", "--config", served.config("carol"))
    events = [json.loads(line) for line in out.splitlines()]
    seqs = [e["seq"] for e in events]
    assert code == 0 and all(isinstance(q, int) for q in seqs) and seqs == sorted(set(seqs))
    assert {tuple(e) for e in events} == {("seq", "job_id", "time_unix", "kind", "round", "worker_id", "message",
                                           "mode")}
    assert {e["mode"] for e in events} == {"sync"}

    for argv in (["status", "--job", "nope-0000"], ["jobs", "show", "nope-0000"], ["jobs", "logs", "nope-0000"],
                 ["jobs", "cancel", "nope-0000"], ["jobs", "download", "nope-0000", "--out", str(served.tmp / "x")]):
        code, out, err = cli(capsys, *argv, "--config", served.config("alice"))
        assert code == 1 and "NOT_FOUND" in err and "no job 'nope-0000'" in err, (argv, out, err)
    code, _, err = cli(capsys, "status", "--json", "--config", served.config("alice"))
    assert code == 0


def test_download_loads_into_build_model_with_the_coordinators_predictions(served, capsys):
    served.worker("w0")
    job_id = submit(served, "alice", JOB)
    assert served.fed.coordinator.wait(job_id, timeout=240) == "completed"
    x = np.random.default_rng(0).normal(size=(16, 1, 8, 8)).astype(np.float32)
    np.save(served.tmp / "x.npy", x)

    for round_number, checkpoint in ((0, checkpoints_of(served.tmp / "checkpoints", job_id)[-1]),
                                     (1, checkpoints_of(served.tmp / "checkpoints", job_id)[0])):
        out_dir = served.tmp / f"download-{round_number}"
        argv = ["jobs", "download", job_id, "--out", str(out_dir), "--json", "--config", served.config("alice")]
        code, out, err = cli(capsys, *argv, *(["--round", str(round_number)] if round_number else []))
        assert code == 0, err
        assert json.loads(out)["round"] == (round_number or 2)
        # the README's own snippet, run as a user would, in the folder, in a fresh interpreter
        readme = (out_dir / "README.md").read_text()
        (snippet,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        script = snippet + (f"import numpy as np, torch\nx = torch.from_numpy(np.load({str(served.tmp / 'x.npy')!r}))\n"
                            f"np.save('predictions.npy', model(x).detach().numpy())\n")
        # `fedbroker` importable as it is once installed (the checkout stands in for the installed package)
        env = {**os.environ, "PYTHONPATH": PYTHONPATH}
        run = subprocess.run([sys.executable, "-c", script], cwd=out_dir, capture_output=True, text=True,
                             timeout=120, env=env)
        assert run.returncode == 0, run.stderr

        tensors, spec_json = load_checkpoint(checkpoint)
        expected_model = build_model(parse_model(json.loads(spec_json)))
        load_numpy_state(expected_model, tensors)
        expected_model.eval()
        expected = expected_model(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_array_equal(np.load(out_dir / "predictions.npy"), expected)
        assert json.loads((out_dir / "job.json").read_text())["name"] == "life"

    code, _, err = cli(capsys, "jobs", "download", job_id, "--round", "7", "--out", str(served.tmp / "none"),
                       "--config", served.config("alice"))
    assert code == 1 and "round 7" in err and "rounds with a model: [1, 2]" in err


def test_logs_follow_prints_events_as_they_happen_and_ends_with_the_job(served):
    served.worker("w0")
    job = dict(JOB, schedule=dict(JOB["schedule"], min_workers=2, wait_for_workers_s=120))
    job_id = submit(served, "alice", job)  # waits for a second worker: the follower starts before anything runs
    seen: list = []
    c = served.client("carol")
    from fedbroker.app.jobs import follow_events

    follower = threading.Thread(target=lambda: seen.extend(follow_events(c, job_id, follow=True)), daemon=True)
    follower.start()
    until(lambda: any(e.kind == "submitted" for e in seen), what="the submitted event")
    assert not any(e.kind == "round_opened" for e in seen)
    served.worker("w1", index=1, count=2)
    follower.join(timeout=240)
    assert not follower.is_alive(), "the follow did not end with the job"
    c.close()
    kinds = [e.kind for e in seen]
    assert kinds[0] == "submitted" and kinds[-1] == "completed", kinds
    for kind in ("running", "round_opened", "uploaded", "round_closed"):
        assert kind in kinds, kinds
    assert kinds.count("round_closed") == 2
    assert [e.seq for e in seen] == sorted({e.seq for e in seen})  # each once, in order


def test_following_streams_are_capped_so_they_cannot_hold_every_server_thread(served):
    from fedbroker.coordinator.service import MAX_FOLLOWERS
    from fedbroker.proto import fedbroker_pb2 as pb
    from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc

    job = dict(JOB, schedule=dict(JOB["schedule"], min_workers=5, wait_for_workers_s=600))
    job_id = submit(served, "alice", job)
    channel = grpc.insecure_channel(served.target)
    stub = pb_grpc.CoordinatorStub(channel)
    md = (("authorization", f"Bearer {served.tokens['carol']}"),)
    calls = [stub.JobEvents(pb.JobEventsRequest(job_id=job_id, follow=True), metadata=md, timeout=120)
             for _ in range(MAX_FOLLOWERS)]
    assert all(next(call).kind == "submitted" for call in calls)  # each is open and following
    with pytest.raises(grpc.RpcError) as refused:
        next(stub.JobEvents(pb.JobEventsRequest(job_id=job_id, follow=True), metadata=md, timeout=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a plain read is never refused, and a follower that goes frees its place (no worker has registered: the
    # submission's warning says so, recorded with it)
    assert [e.kind for e in stub.JobEvents(pb.JobEventsRequest(job_id=job_id), metadata=md, timeout=30)][:2] == [
        "submitted", "warning"]
    calls[0].cancel()
    until(lambda: _opens(stub, job_id, md), what="a follower's place freed")
    for call in calls[1:]:
        call.cancel()
    channel.close()
    c = served.client("alice")
    assert c.cancel(job_id) == "cancelled"
    c.close()


def _opens(stub, job_id, md) -> bool:
    from fedbroker.proto import fedbroker_pb2 as pb

    call = stub.JobEvents(pb.JobEventsRequest(job_id=job_id, follow=True), metadata=md, timeout=30)
    try:
        next(call)
        return True
    except grpc.RpcError:
        return False
    finally:
        call.cancel()


def test_a_job_waiting_for_workers_is_cancelled_before_any_round_opens(served):
    job = dict(JOB, schedule=dict(JOB["schedule"], min_workers=3, wait_for_workers_s=600))
    job_id = submit(served, "alice", job)
    c = served.client("alice")
    until(lambda: c.status(job_id).jobs[0].waiting, what="the job waiting for workers, saying so")
    (row,) = c.status(job_id).jobs
    assert row.status == "pending" and row.waiting.startswith("0 of 3 worker(s) of category 'digits' active"), row
    assert c.cancel(job_id) == "cancelled"
    assert c.status(job_id).jobs[0].waiting == ""  # an ended job waits for nothing
    c.close()
    assert served.fed.coordinator.wait(job_id, timeout=60) == "cancelled"
    assert served.fed.store.rounds(job_id) == [] and served.fed.store.job(job_id).error == "cancelled by alice"
    assert [e.kind for e in served.fed.store.events(job_id)] == [
        "submitted", "warning", "waiting", "cancelling", "cancelled"]


def test_open_rounds_and_jobs_without_an_evaluation_set_show_a_dash_not_zero():
    from fedbroker.app.status import render
    from fedbroker.proto import fedbroker_pb2 as pb

    evaluated = json.dumps({"evaluation": {"dataset": "digits"}})
    status = pb.StatusReply(
        jobs=[pb.JobRow(job_id="a", status="running", spec_json=evaluated),
              pb.JobRow(job_id="b", status="running", spec_json=json.dumps({"evaluation": {"dataset": ""}}))],
        rounds=[pb.RoundRow(job_id="a", round=1, status="closed", accuracy=0.5, loss=1.25, mean_train_loss=0.75),
                pb.RoundRow(job_id="a", round=2, status="open"),
                pb.RoundRow(job_id="b", round=1, status="closed", mean_train_loss=0.5)])
    rows = {tuple(line.split()[:2]): line.split() for line in render(status).split("ROUNDS")[1].splitlines()[3:]
            if line.strip()}
    assert rows[("a", "1")][5:8] == ["0.5000", "1.2500", "0.7500"]
    assert rows[("a", "2")][5:8] == ["-", "-", "-"]
    assert rows[("b", "1")][5:8] == ["-", "-", "0.5000"]
    assert "0.0000" not in render(status)


def test_async_logs_speak_of_versions_and_json_says_the_mode(monkeypatch, capsys):
    import fedbroker.app.jobs as jobs
    from fedbroker.proto import fedbroker_pb2 as pb

    class FakeClient:  # the coordinator's replies for an async job whose first buffer made version 2
        def status(self, job_id):
            return pb.StatusReply(jobs=[pb.JobRow(job_id=job_id, status="completed", mode="async")],
                                  rounds=[pb.RoundRow(job_id=job_id, round=1, status="closed", model_version=2)])

        def events(self, job_id, *, after=0, follow=False):
            return [pb.JobEvent(seq=7, job_id=job_id, time_unix=1.0, kind="round_opened", round=1, message="2 participant(s)"),
                    pb.JobEvent(seq=8, job_id=job_id, time_unix=2.0, kind="round_closed", round=1, message="version 2: 2 of 2")]

        def __enter__(self):  # the CLI holds its client in a `with` block
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(jobs, "client", lambda args: FakeClient())
    assert main(["jobs", "logs", "j"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2:5] for line in lines] == [["buffer_filled", "version", "2"], ["version_published", "version", "2"]]
    assert not any("round" in line.split("  ", 1)[1].split("participant")[0] for line in lines)
    assert main(["jobs", "logs", "j", "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(e["kind"], e["round"], e["seq"], e["mode"]) for e in events] == [("round_opened", 1, 7, "async"),
                                                                                ("round_closed", 1, 8, "async")]


def test_output_into_a_closed_pipe_ends_quietly():
    """`fedbroker jobs logs ID | head`: the reader is gone before the command writes; no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "fedbroker", "token", "alice", "--role", "viewer"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
                              timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == ""


@pytest.mark.parametrize(("argv", "named"), [
    (["--round", "2147483648"], "--round"),
    (["--round", "-1"], "--round"),
    (["--round", "two"], "--round"),
    (["--out", "{file}"], "--out"),
])
def test_a_bad_download_argument_is_refused_before_any_call_without_a_traceback(tmp_path, argv, named):
    """A round the wire cannot carry, or --out naming a file, ends in one line naming the argument; the
    file is left as it was and no coordinator is contacted (the target below refuses every connection)."""
    existing = tmp_path / "model.txt"
    existing.write_text("mine\n")
    argv = [a.replace("{file}", str(existing)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "dl")]
    done = subprocess.run([sys.executable, "-m", "fedbroker", "jobs", "download", "job-1", *argv,
                           "--coordinator", "127.0.0.1:1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert done.returncode == 2, done
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "UNAVAILABLE" not in done.stderr  # refused before connecting
    assert existing.read_text() == "mine\n"
