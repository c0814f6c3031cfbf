"""One small exception hierarchy; services map it to gRPC status codes and exit codes in one table."""

from __future__ import annotations

from enum import StrEnum


class FedbrokerError(Exception):
    """Base of every error this project raises on purpose."""

    reason = "error"


class ConfigError(FedbrokerError, ValueError):
    """A job, config or algorithm parameter is invalid; the message names the field and the limit."""

    reason = "invalid_config"

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class ConfigErrors(ConfigError):
    """Several config problems, reported all at once (like Opacus's validators)."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        FedbrokerError.__init__(self, "; ".join(str(e) for e in errors))
        self.field = errors[0].field
        self.problem = errors[0].problem


class Rejection(StrEnum):
    """Why the aggregation service refused an upload (or a call): the code on the wire and in metric labels.

    Each member knows its gRPC status and whether it is final for a worker: a final refusal will not get
    better by retrying the same task, so the worker reports it and drops the task; any other reason (and any
    code that is not a member, such as a transport's) is retried. `unknown_job` is retried on purpose: a
    restarted aggregation service that lost its state learns the job again from the coordinator.
    deploy/SECURITY.md lists every member for operators (a test holds the table to this enum).
    """

    final: bool
    status: str  # the name of a grpc.StatusCode (this module imports no transport)

    def __new__(cls, value: str, final: bool = False, status: str = "INVALID_ARGUMENT") -> Rejection:
        """A member is its wire code (a str), carrying whether it is final and its gRPC status."""
        member = str.__new__(cls, value)
        member._value_ = value
        member.final = final
        member.status = status
        return member

    # the stream itself (fedbroker.rpc.codec)
    MALFORMED_STREAM = "malformed_stream", False
    TRUNCATED = "truncated", False
    DIGEST_MISMATCH = "digest_mismatch", False
    TOO_LARGE = "too_large", True, "RESOURCE_EXHAUSTED"
    # who may upload what, and when
    UNAUTHENTICATED = "unauthenticated", True, "UNAUTHENTICATED"
    PERMISSION_DENIED = "permission_denied", True, "PERMISSION_DENIED"
    UNKNOWN_JOB = "unknown_job", False, "NOT_FOUND"
    # not final: a service that restarted without its spool learns the job before the round (put_global, then
    # open_round), and an upload between the two must be retried, not given up on
    UNKNOWN_ROUND = "unknown_round", False, "FAILED_PRECONDITION"
    UNKNOWN_WORKER = "unknown_worker", True, "PERMISSION_DENIED"
    LATE = "late", True, "FAILED_PRECONDITION"
    ROUND_CLOSED = "round_closed", True, "FAILED_PRECONDITION"
    BAD_HEADER = "bad_header", True
    TOO_MANY_SAMPLES = "too_many_samples", True  # more samples claimed than the worker registered
    BAD_REQUEST = "bad_request", False
    # the service itself: UNAVAILABLE, which every client already rides out (a worker until its task's
    # deadline, the coordinator for aggregator_outage_s), so a full disk is an outage, never UNKNOWN
    SPOOL_FULL = "spool_full", False, "UNAVAILABLE"
    # the service's thread budget (fedbroker.rpc.callguard): no caller may hold every thread
    SERVER_BUSY = "server_busy", False, "UNAVAILABLE"
    TOO_MANY_STREAMS = "too_many_streams", False, "RESOURCE_EXHAUSTED"
    IDLE_STREAM = "idle_stream", False, "DEADLINE_EXCEEDED"
    # the update against the global model
    UNKNOWN_TENSOR = "unknown_tensor", True
    MISSING_TENSOR = "missing_tensor", True
    WRONG_SHAPE = "wrong_shape", True
    WRONG_DTYPE = "wrong_dtype", True
    NON_FINITE = "non_finite", True
    OUT_OF_RANGE = "out_of_range", True  # a value beyond the job's bound (admission.value_limit)
    # asynchronous mode (FedBuff): the update's base version is more than max_staleness versions behind
    STALE = "stale", True, "FAILED_PRECONDITION"
    # a secure round (aggregation.secure): a step out of its phase, a second different message, or a round
    # whose protocol failed (too few workers left, the service restarted): no retry of the task can help
    SECURE_PROTOCOL = "secure_protocol", True, "FAILED_PRECONDITION"

    @classmethod
    def is_final(cls, reason: str) -> bool:
        """Whether a refusal with this code (as a client reads it off the wire) is final for a worker."""
        member = cls._value2member_map_.get(reason)
        return isinstance(member, Rejection) and member.final


class UploadRejected(FedbrokerError):
    """An update (or a call to the aggregation service) failed validation; `reason` says why."""

    reason: Rejection

    def __init__(self, reason: Rejection, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class NotFound(FedbrokerError):
    """The caller named a job, round or model this service does not hold (gRPC NOT_FOUND)."""

    reason = "not_found"


class UnknownJob(NotFound):
    """The aggregation service holds no such job: after a restart without its spool, the coordinator
    installs the job again when a call comes back with this reason."""

    reason = Rejection.UNKNOWN_JOB


class Conflict(FedbrokerError):
    """The request is valid but the state forbids it now (cancelling a finished job): gRPC FAILED_PRECONDITION,
    which no retry fixes."""

    reason = "conflict"


class Unavailable(FedbrokerError):
    """Something this process needs (its state store, a disk) failed for now, and nothing of the call was
    done: the caller may try again later (gRPC UNAVAILABLE)."""

    reason = "unavailable"


class TaskRefused(FedbrokerError):
    """A worker will not run a task (wrong data category, stale task, ...); the reason goes back to the coordinator."""

    reason = "task_refused"


class BudgetExceeded(TaskRefused):
    """A task would push a worker past its own privacy budget."""

    reason = "privacy_budget_exceeded"


class LedgerBehind(TaskRefused):
    """A worker's privacy ledger holds less ε than the coordinator recorded for it: the ledger was lost or
    replaced, and training from it would spend the owner's budget again."""

    reason = "ledger_behind"


class ModelOverLimits(TaskRefused):
    """A task's model is over one of the site's own ceilings (`worker.limits`: parameters, activation bytes or
    FLOPs per sample): refused with the figures before the model is built or any ε is spent."""

    reason = "model_over_limits"


class BusError(FedbrokerError):
    """The message bus could not deliver or confirm a message."""

    reason = "bus_error"


class Unroutable(BusError):
    """The broker has no queue for a message's routing key (a worker without a task queue): no retry makes
    one appear, so a publisher treats it as final, not as an outage."""

    reason = "unroutable"


class AddressTaken(OSError):
    """A service could not bind its listen address: another process holds the port (services bind exclusively,
    never sharing a port), or the address is not one of this host's."""

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message)
        self.address = address
