"""The face reads the coordinator's statuses at one edge (`fedbroker.app.replies`): the wire's string becomes the
kernel's enum, from a reply's row or from its `--json` form alike, and a status this face does not know is refused
by name rather than compared silently false."""

from __future__ import annotations

import pytest

from fedbroker.app.exits import classify
from fedbroker.app.jobs import as_dict
from fedbroker.app.replies import evaluation_status, job_status, participant_status, read, round_status
from fedbroker.errors import FedbrokerError
from fedbroker.job.status import (
    FINISHED,
    REFUSED_OR_FAILED,
    SENT,
    EvaluationStatus,
    JobStatus,
    ParticipantStatus,
    RoundStatus,
    WorkerState,
)
from fedbroker.proto import fedbroker_pb2 as pb


def reply() -> pb.StatusReply:
    out = pb.StatusReply()
    out.jobs.add(job_id="j", status="completed")
    out.rounds.add(job_id="j", round=1, status="closed")
    out.participants.add(job_id="j", round=1, worker_id="w", status="aggregated")
    out.evaluations.add(job_id="j", round=1, worker_id="w", status="evaluated")
    return out


def test_a_rows_status_reads_as_the_kernels_member_from_the_message_and_from_its_json_form() -> None:
    status = reply()
    for row in (status.jobs[0], as_dict(status.jobs[0])):
        assert job_status(row) is JobStatus.COMPLETED and job_status(row) in FINISHED
    for row in (status.rounds[0], as_dict(status.rounds[0])):
        assert round_status(row) is RoundStatus.CLOSED
    for row in (status.participants[0], as_dict(status.participants[0])):
        assert participant_status(row) is ParticipantStatus.AGGREGATED and participant_status(row) in SENT
    assert evaluation_status(status.evaluations[0]) is EvaluationStatus.EVALUATED


def test_an_unknown_status_is_refused_naming_it_and_the_known_ones() -> None:
    row = pb.ParticipantRow(status="excused")
    with pytest.raises(FedbrokerError, match="ParticipantStatus 'excused'.*it knows published, uploaded") as caught:
        participant_status(row)
    assert classify(caught.value) == (1, "system", str(caught.value))   # one line, exit 1: not a traceback
    with pytest.raises(FedbrokerError, match="JobStatus ''"):
        read(JobStatus, "")


def test_the_statuses_keep_the_strings_the_wire_and_the_state_file_have_always_used() -> None:
    """A face and a coordinator of different releases read each other: the values are the wire's."""
    assert [s.value for s in JobStatus] == ["pending", "running", "cancelling", "completed", "failed", "cancelled"]
    assert [s.value for s in RoundStatus] == ["open", "closed", "failed", "abandoned"]
    assert [s.value for s in ParticipantStatus] == ["published", "uploaded", "aggregated", "missed", "refused",
                                                    "failed", "cancelled", "discarded"]
    assert [s.value for s in EvaluationStatus] == ["asked", "evaluated", "refused", "missed"]
    assert [s.value for s in WorkerState] == ["idle", "training", "uploading"]
    assert {*REFUSED_OR_FAILED} == {"refused", "failed", "missed"} and {*SENT} == {"uploaded", "aggregated"}
