"""One exit-code convention for every verb, and one line per error that says where it came from.

- 0: done.
- 1: refused or failed elsewhere: by a service (`coordinator`), the `broker`, the `job` itself, the local
  `state` folder a command works on, the MLflow store a job is `tracking` into.
- 2: usage or local validation (`usage`, `config`, `file`): a bad flag, job, config or path, refused here
  before anything travels.

Every error is one line on stderr, `fedbroker VERB: ORIGIN: message`, ORIGIN one word from the lists above, so
a script can tell whose problem it is without parsing the message. Ctrl-C exits 130, a closed pipe 141.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

import grpc

from fedbroker.errors import AddressTaken, BusError, ConfigError, FedbrokerError, NotFound

OK, REFUSED, USAGE = 0, 1, 2
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
ORIGINS = ("usage", "config", "file", "coordinator", "broker", "job", "state", "tracking", "system")


def _pika_error() -> tuple[type[BaseException], ...]:
    """pika's exceptions, where pika is loaded (a command that never touched the broker has none)."""
    module = sys.modules.get("pika.exceptions")
    return (module.AMQPError,) if module is not None else ()


def classify(exc: BaseException, *, broker_url: str = "") -> tuple[int, str, str] | None:
    """(exit code, origin, message) for an error a verb let through; None for one that is a bug (a traceback)."""
    if isinstance(exc, ConfigError):
        return USAGE, "config", str(exc)
    if isinstance(exc, grpc.RpcError):  # the CLI's calls all go to the coordinator
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return REFUSED, "coordinator", f"{code.name if code is not None else 'UNKNOWN'}: {details}"
    if isinstance(exc, BusError):
        return REFUSED, "broker", str(exc)
    if isinstance(exc, _pika_error()):
        from fedbroker.bus.amqp_problem import describe

        return REFUSED, "broker", describe(exc, broker_url) if broker_url else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, FedbrokerError):
        return REFUSED, _origin(exc), str(exc)
    if isinstance(exc, TimeoutError):
        return REFUSED, "system", str(exc) or "timed out"
    if isinstance(exc, AddressTaken):  # a port to bind: the operator's setting to change
        return USAGE, "config", _taken(exc.address)
    if isinstance(exc, OSError):  # a path given on the command line or in a config
        return USAGE, "file" if exc.filename else "system", _os_message(exc)
    bind = re.match(r"Failed to bind to address (\S+?);", str(exc)) if isinstance(exc, RuntimeError) else None
    if bind:  # grpc's only word for a port in use: a RuntimeError
        return USAGE, "config", _taken(bind.group(1))
    return None


def _taken(address: str) -> str:
    return (f"cannot listen on {address}: the port is taken, or the address is not one of this host's; choose "
            f"another (--listen, or the service's `listen` setting)")


def _origin(exc: FedbrokerError) -> str:
    """The one word for a FedbrokerError that is not a config problem."""
    reason = str(getattr(exc, "reason", ""))
    if reason in ("job_failed", "federation_failed"):
        return "job"
    if reason == "tracking_failed":
        return "tracking"
    if isinstance(exc, NotFound) or reason in ("conflict", "unavailable"):
        return "state"  # remote refusals arrive as gRPC errors: these come from a local state folder
    return "system"


def _os_message(exc: OSError) -> str:
    what = exc.strerror or str(exc)
    return f"{exc.filename}: {what}" if exc.filename else what


def report(exc: BaseException, verb: str, *, broker_url: str = "") -> int | None:
    """Print the error's one line and return its exit code; None: not ours to explain (let it raise)."""
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    found = classify(exc, broker_url=broker_url)
    if found is None:
        return None
    code, origin, message = found
    print(f"fedbroker {verb}: {origin}: {message}", file=sys.stderr)
    return code


class Parser(argparse.ArgumentParser):
    """argparse with the convention's usage line: `fedbroker VERB: usage: message`, exit 2."""

    def error(self, message: str) -> NoReturn:
        """Print the usage and one line naming the problem, then exit 2."""
        self.print_usage(sys.stderr)
        self.exit(USAGE, f"{self.prog}: usage: {message}\n")
