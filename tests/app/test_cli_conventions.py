"""The CLI's conventions: `fedbroker --help` lists every registered verb, every error is one line
`fedbroker VERB: ORIGIN: message` with the exit code the convention gives its origin, pika stays quiet unless
asked, and `status` / `jobs list` show errors in full."""

from __future__ import annotations

import argparse
import json
import logging
import re
import socket
import subprocess
import sys

import grpc
import pytest
import yaml

from fedbroker.app import exits, jobs
from fedbroker.app.cli import build_parser, main
from fedbroker.app.demo import free_port
from fedbroker.app.logs import BLOCKING_LOGGER, CONNECT_LOGGERS, setup_logging
from fedbroker.app.status import render
from fedbroker.app.tracking import TrackingError
from fedbroker.errors import BusError, ConfigError, NotFound
from fedbroker.proto import fedbroker_pb2 as pb
from tests.source_roots import PYTHONPATH, ROOT


def registered_verbs() -> dict[str, str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: next(a.help for a in sub._choices_actions if a.dest == name) for name in sub.choices}


def test_help_lists_every_registered_verb_with_its_help_and_nothing_else(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = dict(re.findall(r"^    (\S+) +(\S.*)$", out, re.M))
    verbs = registered_verbs()
    assert listed == verbs, (sorted(set(verbs) ^ set(listed)), out)
    assert all(help_text for help_text in verbs.values())
    # the verbs the issue found missing from the old description, and the new ones
    assert {"simulate", "provision", "token", "audit", "new", "teardown", "submit", "jobs"} <= set(listed)
    assert "exit codes: 0 ok, 1 refused" in out and "usage: fedbroker [-h] [--version] COMMAND" in out


def test_a_verb_registered_without_a_group_is_still_listed():
    from fedbroker.app import help as listing

    parser = argparse.ArgumentParser(prog="x")
    sub = parser.add_subparsers()
    sub.add_parser("demo", help="the demo")
    sub.add_parser("brand-new", help="something new")
    text = listing.listing(sub)
    assert re.search(r"^  more\n    brand-new +something new$", text, re.M), text


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedbroker", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH})


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("fedbroker ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_usage_errors_exit_2_with_the_usage_origin():
    done = run("jobs", "download", "j-1", "--round", "two", "--out", "x")
    assert done.returncode == 2
    assert one_error_line(done.stderr).startswith("fedbroker jobs download: usage: argument --round: 'two'")
    done = run("no-such-verb")
    assert done.returncode == 2 and "fedbroker: usage: argument COMMAND: invalid choice: 'no-such-verb'" in done.stderr


def test_local_validation_exits_2_naming_config_or_file(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "category": "digits", "model": {"input_shape": [4], "layers": []}}))
    done = run("submit", str(bad), "--coordinator", f"127.0.0.1:{free_port()}")  # refused before any call
    assert done.returncode == 2
    assert one_error_line(done.stderr).startswith("fedbroker submit: config: model.layers")
    done = run("submit", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2
    assert one_error_line(done.stderr).startswith(f"fedbroker submit: config: job: cannot read {tmp_path}/missing.yaml")
    done = run("status", "--config", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2
    assert one_error_line(done.stderr) == f"fedbroker status: file: {tmp_path}/missing.yaml: No such file or directory"


def test_a_port_already_taken_is_one_config_line_not_a_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = run("aggregator", "--listen", address)
    assert done.returncode == 2
    assert one_error_line(done.stderr) == (
        f"fedbroker aggregator: config: cannot listen on {address}: the port is taken, or the address is not one of "
        f"this host's; choose another (--listen, or the service's `listen` setting)")


def test_a_coordinator_out_of_reach_exits_1_with_the_coordinator_origin():
    done = run("status", "--coordinator", f"127.0.0.1:{free_port()}")
    assert done.returncode == 1
    assert one_error_line(done.stderr).startswith("fedbroker status: coordinator: UNAVAILABLE: ")


class FakeRpcError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INVALID_ARGUMENT

    def details(self) -> str:
        return "model.layers[0]: refused"


@pytest.mark.parametrize(("error", "expected"), [
    (ConfigError("schedule.quorum", "too big"), (2, "config", "schedule.quorum: too big")),
    (FakeRpcError(), (1, "coordinator", "INVALID_ARGUMENT: model.layers[0]: refused")),
    (BusError("cannot reach the broker"), (1, "broker", "cannot reach the broker")),
    (NotFound("no worker 'w' is registered"), (1, "state", "no worker 'w' is registered")),
    (FileNotFoundError(2, "No such file or directory", "/x.yaml"), (2, "file", "/x.yaml: No such file or directory")),
    (TimeoutError("the service did not become healthy"), (1, "system", "the service did not become healthy")),
    (TrackingError("MLflow at http://x:5000: API request failed"), (1, "tracking", "MLflow at http://x:5000: API request failed")),
])
def test_each_kind_of_error_gets_its_exit_code_and_origin(error, expected):
    assert exits.classify(error) == expected
    assert expected[1] in exits.ORIGINS


def test_a_bug_is_not_dressed_up_as_an_error_line():
    assert exits.classify(KeyError("x")) is None  # main re-raises it: a traceback, as a bug deserves
    assert exits.report(KeyboardInterrupt(), "demo") == exits.INTERRUPTED


def test_a_followed_job_that_failed_exits_1_with_the_job_origin():
    from fedbroker.app.submit import JobDidNotComplete

    assert exits.classify(JobDidNotComplete("job j failed after 1/3: boom")) == (1, "job", "job j failed after 1/3: boom")


def test_pika_logs_at_warning_without_its_connect_attempts_unless_debug():
    pika_logger = logging.getLogger("pika")
    saved = (pika_logger.level, [logging.getLogger(n).level for n in CONNECT_LOGGERS],
             list(logging.getLogger(BLOCKING_LOGGER).filters))
    try:
        setup_logging("INFO")
        assert pika_logger.getEffectiveLevel() == logging.WARNING
        assert all(logging.getLogger(n).getEffectiveLevel() > logging.ERROR for n in CONNECT_LOGGERS)
        blocking = logging.getLogger(BLOCKING_LOGGER)
        connect_failure = blocking.makeRecord(BLOCKING_LOGGER, logging.ERROR, "f", 1, "Connection workflow failed",
                                              None, None, func="_create_connection")
        lost = blocking.makeRecord(BLOCKING_LOGGER, logging.ERROR, "f", 1, "Unexpected connection close", None, None,
                                   func="_flush_output")
        assert not blocking.filter(connect_failure) and blocking.filter(lost)
        setup_logging("DEBUG")  # pika then logs as the root logger does (DEBUG, once basicConfig set it)
        assert pika_logger.level == logging.NOTSET and blocking.filter(connect_failure)
        assert all(logging.getLogger(n).level == logging.NOTSET for n in CONNECT_LOGGERS)
    finally:
        pika_logger.setLevel(saved[0])
        for name, level in zip(CONNECT_LOGGERS, saved[1]):
            logging.getLogger(name).setLevel(level)
        logging.getLogger(BLOCKING_LOGGER).filters[:] = saved[2]


LONG_ERROR = ("round 3 not opened: only 1 of the 2 workers can afford it [w1: the round would cost ε 2.850, 0.500 "
              "left of its budget]; no worker trained; the end of this message is where the reason is")


def reply() -> pb.StatusReply:
    status = pb.StatusReply()
    status.jobs.add(job_id="j-1", name="life", status="failed", rounds_done=2, rounds_total=5, error=LONG_ERROR,
                    mode="sync")
    status.jobs.add(job_id="j-2", name="ok", status="completed", rounds_done=5, rounds_total=5, mode="sync")
    return status


def test_status_shows_an_error_in_full():
    assert len(LONG_ERROR) > 80
    table = render(reply())
    (row,) = [line for line in table.splitlines() if line.startswith("j-1")]
    assert row.endswith(LONG_ERROR)


class FakeClient:
    def status(self, job_id: str = "") -> pb.StatusReply:
        return reply()

    def __enter__(self) -> FakeClient:  # the CLI holds its client in a `with` block
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_jobs_list_has_an_error_column_and_the_full_error_in_json(monkeypatch, capsys):
    monkeypatch.setattr(jobs, "client", lambda args: FakeClient())
    assert main(["jobs", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "error"
    (failed,) = [line for line in lines if line.startswith("j-1")]
    (completed,) = [line for line in lines if line.startswith("j-2")]
    assert failed.endswith(LONG_ERROR) and completed.rstrip() == completed  # no trailing blanks for no error
    assert main(["jobs", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["error"] for r in rows] == [LONG_ERROR, ""]
