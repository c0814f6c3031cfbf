"""What tests of the aggregation service's call handling share: a one-layer model and its weights, its job with
round 1 open, a wait on a condition with a deadline, the reason a refusal carries, and an upload stream that
never sends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.installed import install

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})


def weights(value: float) -> dict[str, np.ndarray]:
    """A full state of SPEC, every entry `value`."""
    return {"0.weight": np.full((2, 4), value, np.float32), "0.bias": np.full(2, value, np.float32)}


def open_round_one(client: AggregatorClient, workers: tuple[str, ...] = ("w1", "w2")) -> None:
    """Job `job` on SPEC at version 1 (all zeros), installed with plain settings, its round 1 open to `workers`
    for ten minutes: the calls a coordinator makes before any upload."""
    client.put_global("job", 1, SPEC.to_json(), weights(0.0))
    install(client, "job", {"alignment": "none", "weighting": "fedavg", "selection": "all"})
    client.open_round("job", 1, list(workers), time.time() + 600, seed=0)


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """The predicate's first true value; a loaded machine gets a generous deadline, then the test fails naming `what`."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.02)
    return value


def reason_of(error: grpc.RpcError) -> str | None:
    """The service's machine-readable refusal reason (trailing metadata `fedbroker-reason`)."""
    return dict(error.trailing_metadata() or ()).get("fedbroker-reason")


def silent(release: threading.Event) -> Iterator[pb.UpdateChunk]:
    """An upload that sends nothing until the test ends."""
    release.wait()
    return
    yield  # pragma: no cover
