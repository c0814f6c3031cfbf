"""Every string a site sends, walked from the protobuf descriptors (a field added later is walked too): each is
bounded and printable wherever it lands (issue "Hardening, fourth pass", item 11).

- On the bus: every message kind the coordinator takes from a site (`control.INVALID_REASONS`), each string field
  in turn set to a forged log line with ANSI and OSC escapes, a bidi override and 1 MB of text, through the
  coordinator's real control handler and state store: no log record and no stored text holds a control or hidden
  character, or runs past a bound. What `sites` and `jobs show` print comes from that store (and is printed
  through the same helper: tests/integration/test_site_text.py checks it end to end).
- Over gRPC: every call the aggregation service lets a worker make (its `PERMISSIONS`), each string field of its
  request set to the same text, against the real service on a real port: its refusal's details and its log are
  printable and bounded.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import PERMISSIONS, serve
from fedbroker.coordinator.control import INVALID_REASONS, MAX_REASON_CHARS
from fedbroker.coordinator.store import StateStore
from fedbroker.printable import printable
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.auth import ROLE_WORKER
from fedbroker.rpc.plumbing import MAX_DETAILS_CHARS
from tests.coordinator.control_fakes import control_handler, send

FORGED = "x\n2026-01-01 00:00:00,000 CRITICAL fedbroker.coordinator: FORGED\r\x1b[2J\x1b]0;owned\x07\u202e\b"
BUS_TEXT = FORGED + "A" * 1_000_000
GRPC_TEXT = FORGED + "A" * 100_000   # under gRPC's 4 MiB message limit: the service itself must read it
MAX_LINE = 4 * MAX_REASON_CHARS      # the longest a log record or stored text may run (a few cut fields)


def clean(text: str) -> bool:
    return printable(text) == text and len(text) <= MAX_LINE


def string_paths(descriptor: Descriptor, prefix: tuple[FieldDescriptor, ...] = ()) -> Iterator[
        tuple[FieldDescriptor, ...]]:
    """Every string field a message of this type can hold, as the chain of fields that reaches it."""
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            yield (*prefix, field)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type not in {f.containing_type for f in prefix}:
            yield from string_paths(field.message_type, (*prefix, field))


def with_text(message: Message, path: tuple[FieldDescriptor, ...], text: str) -> Message:
    """A copy of `message` with the field at `path` set to `text` (a repeated field: one more value)."""
    out = type(message)()
    out.CopyFrom(message)
    target: Any = out
    for i, field in enumerate(path[:-1]):
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entries, value = getattr(target, field.name), field.message_type.fields_by_name["value"]
            if path[i + 1].name == "key":  # the forged text as a key (map<string, double>: a site's named sums)
                entries[text] = value.default_value
            else:                          # a map of strings: the forged text as a value
                entries["k"] = text
            return out
        target = getattr(target, field.name).add() if field.is_repeated else getattr(target, field.name)
    last = path[-1]
    if last.is_repeated:
        getattr(target, last.name).append(text)
    else:
        setattr(target, last.name, text)
    return out


def name(path: tuple[FieldDescriptor, ...]) -> str:
    return ".".join(f.name for f in path)


# ----- the bus: every control message a site sends, through the coordinator's handler and store ---------------

def _registration() -> pb.Registration:
    return pb.Registration(worker_id="a", categories=["digits"], num_samples=100, device="cpu", input_shape=[1, 8, 8],
                           num_classes=10, software_version="0.1.0", started_unix=50.0)


# A valid message of each kind a site sends: the forged field is the only thing wrong with it.
VALID: dict[str, Message] = {
    "registration": _registration(),
    "heartbeat": pb.Heartbeat(worker_id="a", state="idle", job_costs=[pb.JobCost(job_id="j-1", known=True)]),
    "task_outcome": pb.TaskOutcome(job_id="j-1", round=1, worker_id="a", status=pb.TaskOutcome.FAILED, reason="r"),
    "share_reply": pb.ShareReply(job_id="j-1", worker_id="a", refused=True, reason="r"),
    "evaluation_report": pb.EvaluationReport(job_id="j-1", round=1, model_version=1, worker_id="a", refused=True,
                                             reason="r"),
    "site_log": pb.SiteLog(worker_id="a", time_unix=1.0, level="ERROR", logger="fedbroker.worker", message="m"),
}
BUS_CASES = [(kind, path) for kind in sorted(VALID) for path in string_paths(VALID[kind].DESCRIPTOR)]


def test_every_message_kind_a_site_sends_on_the_bus_is_walked() -> None:
    assert set(VALID) == set(INVALID_REASONS)  # a new kind of control message needs its valid example here
    assert len(BUS_CASES) >= 12


def stored_texts(path: Path) -> Iterator[tuple[str, str]]:
    """Every text value in the coordinator's state store, with the table it is in."""
    db = sqlite3.connect(path)
    try:
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            for row in db.execute(f'SELECT * FROM "{table}"'):
                yield from ((table, value) for value in row if isinstance(value, str))
    finally:
        db.close()


@pytest.mark.parametrize(("kind", "path"), BUS_CASES, ids=[f"{k}.{name(p)}" for k, p in BUS_CASES])
def test_a_forged_string_in_a_control_message_is_logged_and_stored_bounded_and_printable(
        kind: str, path: tuple[FieldDescriptor, ...], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "coordinator.sqlite"
    store = StateStore(str(db))
    try:
        handler = control_handler(store, {"site-a": ["a"]}, namespace="strings")
        assert send(handler, "site-a", registration=VALID["registration"]).settled_as == "ack"
        store.add_job("j-1", "j", "{}", 1, "{}")
        store.open_round("j-1", 1, ["a"])
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            forged = with_text(VALID[kind], path, BUS_TEXT)
            send(handler, "site-a", **{kind: forged})
        assert caplog.records, "the handler logged nothing: the walk would not see a forged line"
        for record in caplog.records:
            assert clean(record.getMessage()), f"logged: {record.getMessage()[:300]!r}"
        for table, text in stored_texts(db):
            assert clean(text), f"stored in {table}: {text[:300]!r}"
    finally:
        store.close()


# ----- gRPC: every call a worker may make to the aggregation service ------------------------------------------

SERVICES = ("Aggregation", "WorkerPresence")  # the services of the aggregation port a worker may call
METHODS = {m.name: m for s in SERVICES for m in pb.DESCRIPTOR.services_by_name[s].methods}
WORKER_CALLS = sorted(m for m, roles in PERMISSIONS.items() if ROLE_WORKER in roles)
GRPC_CASES = [(call, path) for call in WORKER_CALLS
              for path in string_paths(METHODS[call].input_type)]


@pytest.fixture(scope="module")
def aggregator() -> Iterator[dict[str, Any]]:
    server, port = serve(RoundBook())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield {s: getattr(pb_grpc, f"{s}Stub")(channel) for s in SERVICES}
    finally:
        channel.close()
        server.stop(grace=0)


def test_every_call_a_worker_may_make_is_walked() -> None:
    assert {"UploadUpdate", "UploadWhole", "StartTask", "SecAdvertise", "SecUnmask"} <= set(WORKER_CALLS)
    assert {name(p) for c, p in GRPC_CASES if c == "UploadUpdate"} >= {"header.worker_id", "header.tensors.dtype"}


@pytest.mark.parametrize(("call", "path"), GRPC_CASES, ids=[f"{c}.{name(p)}" for c, p in GRPC_CASES])
def test_a_forged_string_in_a_workers_call_comes_back_and_is_logged_bounded_and_printable(
        call: str, path: tuple[FieldDescriptor, ...], aggregator: dict[str, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    method = METHODS[call]
    fields = method.input_type.fields_by_name
    ids = {k: v for k, v in (("job_id", "j-1"), ("round", 1), ("worker_id", "a")) if k in fields}
    request = with_text(getattr(pb, method.input_type.name)(**ids), path, GRPC_TEXT)
    stub = getattr(aggregator[method.containing_service.name], call)
    with caplog.at_level(logging.DEBUG):
        try:
            reply = stub(iter([request]), timeout=30) if method.client_streaming else stub(request, timeout=30)
            if method.server_streaming:
                list(reply)
        except grpc.RpcError as exc:
            details = exc.details() or ""  # type: ignore[attr-defined]
            assert exc.code() != grpc.StatusCode.INTERNAL, details  # type: ignore[attr-defined]
            assert printable(details) == details and len(details) <= MAX_DETAILS_CHARS + 100, details[:300]
    for record in caplog.records:
        assert clean(record.getMessage()), f"logged: {record.getMessage()[:300]!r}"
