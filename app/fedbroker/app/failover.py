"""The CLI's coordinator client over several coordinators (`coordinator.targets`, `--coordinator a,b`): a call
that one answers UNAVAILABLE (a standby's `standby`, or nothing listening: the old leader is gone) is made again
at the next, and the one that answered is asked first from then on.

Only UNAVAILABLE moves on: it means the call was not served (a standby serves nothing, a store outage records
nothing), so asking the next coordinator never does a thing twice. Every other answer, a refusal included, is
the caller's. A stream moves on only before its first message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import grpc

from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.coordinator.standby_gate import LEADER_KEY
from fedbroker.errors import ConfigError
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import CHANNEL_OPTIONS, reason_of

log = logging.getLogger(__name__)

STREAMING = frozenset({"JobEvents", "DownloadModel"})   # the coordinator's server-streaming calls


def targets_of(named: str | None, targets: Sequence[str], target: str) -> list[str]:
    """The coordinators to try, in order: `--coordinator` (comma-separated), else coordinator.targets, else
    coordinator.target."""
    if named:
        listed = [t.strip() for t in named.split(",") if t.strip()]
        if not listed:
            raise ConfigError("--coordinator", f"names no coordinator: {named!r}")
        return listed
    return list(targets) or [target]


def _moves_on(error: grpc.RpcError) -> bool:
    return bool(error.code() == grpc.StatusCode.UNAVAILABLE)


def _why(error: grpc.RpcError) -> str:
    if reason_of(error) != "standby":
        return f"unavailable ({error.details()})"
    leader = next((str(v) for k, v in cast("Sequence[tuple[str, Any]]", error.trailing_metadata() or ())
                   if k == LEADER_KEY), "")
    return f"a standby (leader: {leader or 'none yet'})"


class _FailoverStub:
    """Quacks like pb_grpc.CoordinatorStub: each method tries every coordinator's stub in turn."""

    def __init__(self, stubs: Sequence[pb_grpc.CoordinatorStub], targets: Sequence[str]) -> None:
        self._stubs, self._targets = list(stubs), list(targets)
        self._first = 0  # the coordinator that answered last

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        if method in STREAMING:
            return lambda *args, **kwargs: self._stream(method, args, kwargs)
        return lambda *args, **kwargs: self._unary(method, args, kwargs)

    def _order(self) -> list[int]:
        count = len(self._stubs)
        return [(self._first + i) % count for i in range(count)]

    def _skip(self, index: int, error: grpc.RpcError) -> None:
        log.info("coordinator %s is %s: trying the next of %s", self._targets[index], _why(error),
                 ", ".join(self._targets))

    def _unary(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        last: grpc.RpcError | None = None
        for index in self._order():
            try:
                reply = getattr(self._stubs[index], method)(*args, **kwargs)
            except grpc.RpcError as error:
                if not _moves_on(error):
                    raise
                self._skip(index, error)
                last = error
                continue
            self._first = index
            return reply
        assert last is not None
        raise last

    def _stream(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
        last: grpc.RpcError | None = None
        for index in self._order():
            stream = getattr(self._stubs[index], method)(*args, **kwargs)
            try:
                first = next(stream)
            except StopIteration:
                self._first = index
                return
            except grpc.RpcError as error:
                if not _moves_on(error):
                    raise
                self._skip(index, error)
                last = error
                continue
            self._first = index
            yield first
            yield from stream
            return
        assert last is not None
        raise last


class FailoverClient(CoordinatorClient):
    """A CoordinatorClient whose calls go to whichever of `targets` serves them (one channel each)."""

    def __init__(self, targets: Sequence[str], *, timeout_s: float = 30.0, security: ClientSecurity | None = None) -> None:
        if not targets:
            raise ConfigError("coordinator.targets", "names no coordinator")
        super().__init__(targets[0], timeout_s=timeout_s, security=security)
        self.targets = list(targets)
        secured = security or ClientSecurity()
        self._channels = [self._channel, *(secured.channel(t, CHANNEL_OPTIONS) for t in self.targets[1:])]
        stub = _FailoverStub([pb_grpc.CoordinatorStub(c) for c in self._channels], self.targets)
        self._stub = cast("pb_grpc.CoordinatorStub", stub)

    def close(self) -> None:
        """Close every channel."""
        for channel in self._channels:
            channel.close()


def coordinator_client(targets: Sequence[str], *, security: ClientSecurity | None = None) -> CoordinatorClient:
    """One coordinator's plain client, or a failover client over several."""
    if len(targets) == 1:
        return CoordinatorClient(targets[0], security=security)
    return FailoverClient(targets, security=security)
