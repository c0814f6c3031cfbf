"""Where the face reads the coordinator's statuses. The wire carries them as strings (the `status` of a
StatusReply's rows and of a CancelJobReply, and the rows of `jobs show --json` that tracking reads back); each
becomes the kernel's enum here (`fedbroker.job.status`), so the rest of the face compares enum members. A status
this face does not know is an error naming it and the ones it knows, never a comparison that is silently false.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from fedbroker.errors import FedbrokerError
from fedbroker.job.status import EvaluationStatus, JobStatus, ParticipantStatus, RoundStatus

S = TypeVar("S", JobStatus, RoundStatus, ParticipantStatus, EvaluationStatus)


def read(kind: type[S], text: str) -> S:
    """`text` as a member of `kind`; an unknown one (a coordinator newer than this face) is refused by name."""
    try:
        return kind(text)
    except ValueError:
        raise FedbrokerError(f"the coordinator reported a {kind.__name__} {text!r} this fedbroker does not know "
                             f"(it knows {', '.join(kind)}): is the coordinator a newer release?") from None


def _status(row: Any) -> str:
    """A row's `status`: a reply's message, or its `as_dict` form."""
    return str(row["status"] if isinstance(row, Mapping) else row.status)


def job_status(row: Any) -> JobStatus:
    """A JobRow's status."""
    return read(JobStatus, _status(row))


def round_status(row: Any) -> RoundStatus:
    """A RoundRow's status."""
    return read(RoundStatus, _status(row))


def participant_status(row: Any) -> ParticipantStatus:
    """A ParticipantRow's status."""
    return read(ParticipantStatus, _status(row))


def evaluation_status(row: Any) -> EvaluationStatus:
    """An EvaluationRow's status."""
    return read(EvaluationStatus, _status(row))
