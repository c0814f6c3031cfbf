"""The statuses a job and its parts move through, as the coordinator records them and every reader of its replies
compares them: the job, its rounds, the workers asked to train a round or to score one, and a worker's state.

They are `StrEnum`s whose values are the strings the coordinator's SQLite file, the wire (StatusReply's string
fields) and `fedbroker status` have always used: a status compares equal to its old string, prints as it, and a
state file written before the enums reads back unchanged. They live in the kernel so the coordinator (which writes
them) and the face (which reads them off a reply) share one list, and a misspelt status is an AttributeError, not
a comparison that is silently never true.
"""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    """A job's place in its life: `pending` until its thread starts, `cancelling` until its thread acts."""

    PENDING = "pending"
    RUNNING = "running"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


# A job in one of these has ended: nothing more happens to it (a cancel is refused).
FINISHED = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})


class RoundStatus(enum.StrEnum):
    """A round is `open` from before the aggregation service hears of it until it is closed into a version,
    fails (too few uploads) or is abandoned (its job was cancelled: no version comes of it)."""

    OPEN = "open"
    CLOSED = "closed"
    FAILED = "failed"
    ABANDONED = "abandoned"


class ParticipantStatus(enum.StrEnum):
    """A selected worker's part in one round: `published` (its task went out) until it uploads, answers
    (refused, failed), misses the close, or its job is cancelled (cancelled; discarded if it had uploaded)."""

    PUBLISHED = "published"
    UPLOADED = "uploaded"
    AGGREGATED = "aggregated"
    MISSED = "missed"
    REFUSED = "refused"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DISCARDED = "discarded"


# A worker in one of these sent its update (kept by the close, or the round is still open).
SENT = frozenset({ParticipantStatus.UPLOADED, ParticipantStatus.AGGREGATED})
# A worker in one of these gave the round nothing: it said no, its training failed, or it missed the close.
REFUSED_OR_FAILED = frozenset({ParticipantStatus.REFUSED, ParticipantStatus.FAILED, ParticipantStatus.MISSED})


class EvaluationStatus(enum.StrEnum):
    """A site's part in one round's evaluation: `asked` until it reports (evaluated, refused) or the deadline
    passes without a report or with its task never delivered (missed)."""

    ASKED = "asked"
    EVALUATED = "evaluated"
    REFUSED = "refused"
    MISSED = "missed"


class WorkerState(enum.StrEnum):
    """What a worker's last heartbeat said it was doing."""

    IDLE = "idle"
    TRAINING = "training"
    UPLOADING = "uploading"
