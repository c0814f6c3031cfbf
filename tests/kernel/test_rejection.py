"""One enum of upload rejection reasons: the wire codes, their gRPC statuses, the worker's final/retry split,
the metric labels and the operators' table in deploy/SECURITY.md all come from `fedbroker.errors.Rejection`."""

from __future__ import annotations

import ast
import re

import grpc
import pytest

from fedbroker.errors import Rejection, UploadRejected
from fedbroker.rpc.plumbing import status_for
from tests.source_roots import ROOT

ROW = re.compile(r"^\| `(?P<reason>[a-z_]+)` \| `(?P<status>[A-Z_]+)` \| (?P<worker>final|retries) \|", re.M)


def documented() -> dict[str, tuple[str, bool]]:
    text = (ROOT / "deploy" / "SECURITY.md").read_text(encoding="utf-8")
    return {m["reason"]: (m["status"], m["worker"] == "final") for m in ROW.finditer(text)}


def test_the_operators_table_lists_every_reason_with_its_status_and_finality():
    assert documented() == {r.value: (r.status, r.final) for r in Rejection}


@pytest.mark.parametrize("reason", list(Rejection), ids=str)
def test_each_reason_maps_to_its_grpc_status(reason):
    assert status_for(UploadRejected(reason, "x")) == grpc.StatusCode[reason.status]


def test_the_wire_codes_are_unchanged():
    assert {r.value for r in Rejection} == {
        "malformed_stream", "truncated", "digest_mismatch", "too_large", "unauthenticated", "permission_denied",
        "unknown_job", "unknown_round", "unknown_worker", "late", "round_closed", "bad_header", "too_many_samples", "bad_request",
        "spool_full", "server_busy", "too_many_streams", "idle_stream", "unknown_tensor", "missing_tensor", "wrong_shape", "wrong_dtype", "non_finite", "out_of_range", "stale",
        "secure_protocol"}
    assert Rejection.LATE == "late" and f"{Rejection.LATE}" == "late"


def test_what_a_worker_gives_up_on_comes_from_the_enum():
    final = {r.value for r in Rejection if r.final}
    assert {"late", "round_closed", "wrong_shape", "non_finite", "unauthenticated", "permission_denied"} <= final
    # a restarted service (it learns the job, then its round), a broken stream
    assert not {"unknown_job", "unknown_round", "truncated", "digest_mismatch"} & final
    assert all(Rejection.is_final(r) for r in final)
    assert not Rejection.is_final("unavailable") and not Rejection.is_final("")  # not a refusal: retried


def test_the_worker_holds_no_copy_of_the_reason_codes():
    tree = ast.parse((ROOT / "worker" / "fedbroker" / "worker" / "agent.py").read_text(encoding="utf-8"))
    codes = {r.value for r in Rejection}
    copied = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in codes]
    assert not copied, f"worker/agent.py spells reason codes itself: {copied}; ask fedbroker.errors.Rejection"


def test_every_reason_has_a_rejection_series_from_the_start():
    from prometheus_client import REGISTRY

    import fedbroker.aggregators.metrics  # noqa: F401  (defines and initialises the series)

    for reason in Rejection:
        value = REGISTRY.get_sample_value("fedbroker_aggregator_uploads_rejected_total", {"reason": reason.value})
        assert value is not None, reason
