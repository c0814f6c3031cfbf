"""A broker nobody answers for: one clear line (host, port, reason, what to check) instead of pika's tracebacks
and `failed (AMQPConnectionError: )`. Nothing listens on the port used here (bound, then closed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedbroker.bus.amqp_problem import describe
from tests.source_roots import PYTHONPATH

CLEAR = ("cannot reach the broker at 127.0.0.1:{port} (virtual host /, user guest): connection refused: nothing "
         "listens there; check that RabbitMQ runs and listens on that port, and that broker.url names its host and port")


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    return {**clean, "PYTHONPATH": PYTHONPATH}


def test_a_command_that_needs_the_broker_says_why_in_one_line_and_exits_1():
    port = dead_port()
    done = subprocess.run([sys.executable, "-m", "fedbroker", "teardown", "--namespace", "nobody-here",
                           "--broker", f"amqp://guest:guest@127.0.0.1:{port}/"], capture_output=True, text=True,
                          timeout=120, env=env())
    assert done.returncode == 1
    assert done.stderr == f"fedbroker teardown: broker: {CLEAR.format(port=port)}\n"


@pytest.mark.timeout(300)
def test_a_worker_out_of_reach_of_its_broker_logs_one_clear_line_and_no_pika_traceback(tmp_path: Path):
    """pika's own report of a failed connect comes before the bus's line (the same thread writes both), so once
    the bus's line is there, whatever pika said about that attempt is there too."""
    port = dead_port()
    log = tmp_path / "worker.log"
    settings = {"FEDBROKER__BROKER__URL": f"amqp://guest:guest@127.0.0.1:{port}/", "FEDBROKER__WORKER__ID": "w1",
                "FEDBROKER__WORKER__LEDGER_PATH": str(tmp_path / "ledger.json"), "FEDBROKER__WORKER__DEVICE": "cpu"}
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "fedbroker", "worker"], env={**env(), **settings},
                                  stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240  # a hang guard: the line comes at the worker's first connect
        while "cannot reach the broker" not in log.read_text() and worker.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    text = log.read_text()
    lines = [line for line in text.splitlines() if "cannot reach the broker" in line]
    assert lines and lines[0].endswith(f"WARNING fedbroker.bus.amqp_link: bus: {CLEAR.format(port=port)}; "
                                       f"retrying in {lines[0].rsplit(' ', 1)[1]}"), text
    assert "Traceback" not in text and " pika." not in text and "AMQPConnectionError" not in text, text


@pytest.mark.parametrize(("make", "reason"), [
    (lambda: __import__("pika.exceptions").exceptions.ProbableAuthenticationError("ACCESS_REFUSED"),
     "the broker refused the login of user 'guest'; check the user and password in broker.url"),
    (lambda: __import__("pika.exceptions").exceptions.ProbableAccessDeniedError("vhost"),
     "user 'guest' may not use virtual host 'team'"),
    (lambda: socket.gaierror(-2, "Name or service not known"),
     "the host name 'broker.invalid' does not resolve (Name or service not known)"),
    (lambda: TimeoutError("timed out"), "no answer (timed out); check a firewall"),
    # as pika reports a handshake the broker refused with a TLS alert (a revoked certificate, with its CRL check)
    (lambda: __import__("pika.exceptions").exceptions.IncompatibleProtocolError(
        "StreamLostError: (\"Stream connection lost: SSLError(1, '[SSL: SSLV3_ALERT_CERTIFICATE_REVOKED] sslv3 "
        "alert certificate revoked (_ssl.c:2580)')\",)"),
     "the broker refused this client's certificate: it is revoked (the project's CRL); check with the project's"),
])
def test_each_kind_of_connect_failure_names_its_reason(make, reason):
    host = "broker.invalid" if "resolve" in reason else "127.0.0.1"
    vhost = "team" if "virtual host" in reason else "%2F"
    line = describe(make(), f"amqp://guest:secret@{host}:5672/{vhost}")
    assert reason in line and "secret" not in line, line
    assert line.startswith(f"cannot reach the broker at {host}:5672")


def test_both_links_say_a_problem_once_then_a_reminder_every_tenth_attempt(caplog):
    from fedbroker.bus.amqp_problem import REMIND_EVERY, ProblemLog

    problems = ProblemLog()
    url = f"amqp://guest:guest@127.0.0.1:{dead_port()}/"
    refused = ConnectionRefusedError(111, "Connection refused")
    with caplog.at_level("DEBUG", logger="fedbroker.bus.amqp_link"):
        for attempt in range(2 * REMIND_EVERY + 1):
            problems.failed("publisher" if attempt % 2 else "consumer", refused, url, connected_before=False, delay=1)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 3 and warnings[0].startswith("bus: cannot reach the broker")
        assert warnings[1].startswith("bus: still cannot reach") and f"({REMIND_EVERY + 1} failed attempts)" in warnings[1]
        caplog.clear()
        problems.connected()  # up again: the next problem is news
        problems.failed("consumer", refused, url, connected_before=True, delay=1)
        (lost,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert lost.startswith("bus: lost the connection to the broker at 127.0.0.1:")


@pytest.mark.parametrize("scheme", ["amqp", "amqps"])
def test_a_connection_closed_before_the_amqp_handshake_is_not_called_a_peer_that_does_not_speak_amqp(scheme):
    """What a revoked site's worker meets (the broker ends the connection after its TLS handshake, or closes a
    deleted user's): pika's IncompatibleProtocolError, from a real connection to a peer that closes it. It was
    logged as "does not speak AMQP 0-9-1", which sent operators after the port instead of the revocation."""
    import threading

    import pika

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def close_each() -> None:
        while True:
            try:
                peer, _ = server.accept()
            except OSError:
                return
            peer.recv(64)
            peer.close()

    threading.Thread(target=close_each, daemon=True).start()
    port = server.getsockname()[1]
    params = pika.URLParameters(f"amqp://guest:guest@127.0.0.1:{port}/")
    params.connection_attempts = 1
    try:
        with pytest.raises(pika.exceptions.AMQPConnectionError) as closed:
            pika.BlockingConnection(params)
    finally:
        server.close()
    line = describe(closed.value, f"{scheme}://guest:guest@127.0.0.1:{port}/")
    assert "does not speak" not in line, line
    if scheme == "amqps":
        assert "the broker closed the connection right after the TLS handshake" in line
        assert "whether this participant's certificate was revoked" in line
    else:
        assert "the connection was closed before the AMQP handshake finished" in line
