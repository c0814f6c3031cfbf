"""`fedbroker submit --json --follow | --wait` against the real coordinator gRPC server, RabbitMQ and a worker:
the id and warnings as JSON, the job's events streamed to its end, and the exit code by how it ended."""

from __future__ import annotations

import json

import pytest
import yaml

from fedbroker.app.cli import main
from tests.lifecycle.test_jobs import JOB, Served, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def served(rabbitmq_url, tmp_path):
    s = Served(rabbitmq_url, tmp_path)
    yield s
    s.close()


def job_file(served: Served, job: dict) -> str:
    path = served.tmp / f"{job['name']}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_submit_json_follow_streams_the_events_and_exits_0_when_the_job_completes(served, capsys):
    served.worker("w0")
    until(lambda: served.fed.store.workers("digits"), what="w0 registered")
    code = main(["submit", job_file(served, JOB), "--json", "--follow", "--config", served.config("alice")])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    first, events, last = lines[0], lines[1:-1], lines[-1]
    assert set(first) == {"job_id", "warnings", "epsilon_projection", "model_bounds"} and first["warnings"] == []
    assert first["model_bounds"]["parameters"] == 2410
    job_id = first["job_id"]
    assert served.fed.store.job(job_id).status == "completed"
    kinds = [e["kind"] for e in events]
    assert kinds.count("round_closed") == 2 and all(e["job_id"] == job_id for e in events)
    assert [e["seq"] for e in events] == sorted({e["seq"] for e in events})  # each event once, in order
    assert last == {"job_id": job_id, "status": "completed", "rounds_done": 2, "rounds_total": 2, "error": ""}


def test_submit_wait_exits_1_with_the_jobs_error_and_warns_what_it_can_see(served, capsys):
    served.worker("w0")  # active, but of another category than the job's
    until(lambda: served.fed.store.workers("digits"), what="w0 registered")
    job = {**JOB, "evaluation": {"every": 0}}  # own data, nothing to score it: the coordinator warns
    job.update(name="lonely", category="nobody", schedule={**JOB["schedule"], "wait_for_workers_s": 1})
    code = main(["submit", job_file(served, job), "--wait", "--config", served.config("alice")])
    out, err = capsys.readouterr()
    assert code == 1
    job_id = out.splitlines()[0]  # the id first, alone on its line: JOB=$(fedbroker submit ...) still works
    assert served.fed.store.job(job_id).status == "failed"
    assert out.splitlines()[1] == f"job {job_id} failed (0/2)"
    assert "fedbroker submit: warning: evaluation.every is 0 and the job names no evaluation.dataset" in err
    assert "fedbroker submit: warning: no registered worker serves category 'nobody'" in err
    assert "fedbroker submit: model: 2,410 parameters; per sample" in err  # the model's bounds, what sites' limits compare with
    (error,) = [line for line in err.splitlines() if not line.startswith(("fedbroker submit: warning:",
                                                                          "fedbroker submit: model:"))]
    assert error.startswith(f"fedbroker submit: job: job {job_id} failed after 0/2: only 0 active worker(s) of "
                            f"category 'nobody'")


def test_a_viewer_cannot_submit_and_nothing_is_followed(served, capsys):
    code = main(["submit", job_file(served, JOB), "--follow", "--config", served.config("carol")])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("fedbroker submit: coordinator: PERMISSION_DENIED: ")
