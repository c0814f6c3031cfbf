"""One small exception hierarchy; services map it to gRPC status codes and exit codes in one table."""

from __future__ import annotations


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


class UploadRejected(FedbrokerError):
    """An update failed validation; `reason` is a short, low-cardinality code for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class NotFound(FedbrokerError):
    reason = "not_found"


class Conflict(FedbrokerError):
    reason = "conflict"


class Unauthenticated(FedbrokerError):
    reason = "unauthenticated"


class TaskRefused(FedbrokerError):
    """A worker will not run a task (wrong data category, stale task, ...); the reason goes back to the coordinator."""

    reason = "task_refused"


class BudgetExceeded(TaskRefused):
    """A task would push a worker past its own privacy budget."""

    reason = "privacy_budget_exceeded"


class BusError(FedbrokerError):
    """The message bus could not deliver or confirm a message."""

    reason = "bus_error"
