"""Whether an upload may enter its round: pure checks that raise `UploadRejected` naming the reason.

The header is judged before any tensor data is read (membership, timing, sample count, tensor specs), the
values once they have arrived (finite). The caller snapshots what its state says about the round
(`Standing`); nothing here holds state or takes a lock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedbroker.errors import Rejection, UploadRejected
from fedbroker.job.model_spec import ModelSpec
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.weights.plan import ModelPlan, frozen_owner

FINITE_BLOCK = 1 << 16  # values checked at a time: no model-sized boolean temporary
# Without a declared `aggregation.max_update_value`, an uploaded value may be this many times the newest global
# model's largest (at least 1): room for any honest training, none for a value whose arithmetic overflows.
DERIVED_HEADROOM = 1e4
TensorSpecs = Mapping[str, tuple[tuple[int, ...], str]]  # name → (shape, dtype)


@dataclass(frozen=True)
class Standing:
    """What the book knows of the round an upload names when its header arrives."""

    participants: frozenset[str] | None  # None: not the job's current round (closed long ago, or never opened)
    deadline: float | None               # the current round's, else a recently closed round's, else None
    closed: bool
    sample_limits: Mapping[str, int] = field(default_factory=dict)  # participants' registered sample counts
    beyond: bool = False                 # past the service's state (JobState.beyond): it never opens here


def check_membership(header: pb.UpdateHeader, standing: Standing, *, now: float) -> None:
    """A straggler is `late` (whether or not its round has closed at its deadline yet); then closed, unknown."""
    current = standing.participants
    if standing.deadline is not None and now > standing.deadline and (current is None or header.worker_id in current):
        raise UploadRejected(
            Rejection.LATE, f"worker {header.worker_id!r}: round {header.round} deadline passed; late update refused"
        )
    if standing.closed:
        raise UploadRejected(Rejection.ROUND_CLOSED, f"round {header.round} of job {header.job_id!r} is already closed")
    if standing.beyond:  # final: the coordinator re-sends the tasks of the round it resumed
        raise UploadRejected(Rejection.ROUND_CLOSED, f"round {header.round} of job {header.job_id!r} lies past this "
                                                     f"service's state (a task from before a restore): dropped")
    if current is None:
        raise UploadRejected(Rejection.UNKNOWN_ROUND, f"round {header.round} of job {header.job_id!r} is not open")
    if header.worker_id not in current:
        raise UploadRejected(
            Rejection.UNKNOWN_WORKER, f"worker {header.worker_id!r} is not a participant of round {header.round}"
        )


def check_header(header: pb.UpdateHeader, shapes: Mapping[str, tuple[int, ...]], *,
                 max_samples: int | None = None) -> None:
    """The sample count (positive, and at most `max_samples`, what the worker registered: a FedAvg weight is
    a sample count, so an unbounded claim would let one upload set the global model), and the announced
    tensors against the global model's (float32) shapes."""
    if header.num_samples <= 0:
        raise UploadRejected(Rejection.BAD_HEADER, f"num_samples must be positive, got {header.num_samples}")
    if max_samples is not None and header.num_samples > max_samples:
        raise UploadRejected(Rejection.TOO_MANY_SAMPLES,
                             f"worker {header.worker_id!r} claims {header.num_samples} samples, more than the "
                             f"{max_samples} it registered")
    check_specs({name: (shape, "float32") for name, shape in shapes.items()},
                {t.name: (tuple(t.shape), t.dtype) for t in header.tensors}, who=f"worker {header.worker_id!r}")


def check_trains(header: pb.UpdateHeader, spec: ModelSpec, plan: ModelPlan) -> None:
    """An upload carrying a tensor the job does not train (a frozen node's, an adapter's base weight) is refused
    naming it and why: a site never sends, and the service never averages, what is frozen."""
    if not plan.restricts_training:
        return
    for tensor in header.tensors:
        why = frozen_owner(tensor.name, spec, plan)
        if why:
            raise UploadRejected(Rejection.UNKNOWN_TENSOR, f"worker {header.worker_id!r}: tensor {tensor.name!r} "
                                                           f"does not train in this job ({why}); it is never uploaded")


def check_specs(wanted: TensorSpecs, got: TensorSpecs, *, who: str) -> None:
    """An update must hold exactly the model's tensors, each of its shape, as float32."""
    unknown = sorted(set(got) - set(wanted))
    if unknown:
        raise UploadRejected(Rejection.UNKNOWN_TENSOR,
                             f"{who}: unknown tensor {unknown[0]!r}; the model has {sorted(wanted)}")
    missing = sorted(set(wanted) - set(got))
    if missing:
        raise UploadRejected(Rejection.MISSING_TENSOR, f"{who}: tensor {missing[0]!r} is missing")
    for name, (shape, dtype) in wanted.items():
        got_shape, got_dtype = got[name]
        if got_shape != shape:
            raise UploadRejected(Rejection.WRONG_SHAPE,
                                 f"{who}: tensor {name!r} has shape {list(got_shape)}, expected {list(shape)}")
        if got_dtype != dtype:
            raise UploadRejected(Rejection.WRONG_DTYPE, f"{who}: tensor {name!r} has dtype {got_dtype}, expected {dtype}")


def check_global_model(shapes: Mapping[str, tuple[int, ...]], tensors: Mapping[str, np.ndarray]) -> None:
    """A global model being installed must match its spec exactly and hold finite values only."""
    check_specs({n: (s, "float32") for n, s in shapes.items()},
                {n: (tuple(a.shape), "float32") for n, a in tensors.items()}, who="the global model")
    check_finite(tensors, who="the global model")


def value_limit(*, declared: float, model: Mapping[str, np.ndarray]) -> float:
    """The largest magnitude an uploaded value may have: the job's `aggregation.max_update_value`, else
    DERIVED_HEADROOM times the global model's largest magnitude (at least 1)."""
    if declared > 0:
        return declared
    largest = max((float(np.max(np.abs(a))) for a in model.values() if np.size(a)), default=0.0)
    return DERIVED_HEADROOM * max(1.0, largest)


def check_finite(tensors: Mapping[str, np.ndarray], *, who: str, limit: float = math.inf) -> None:
    """Refuse an update with a NaN or infinity (`non_finite`), or a value beyond `limit` in magnitude
    (`out_of_range`): a finite 3e38 overflows the rules' and the mean's float arithmetic just the same, and one
    such upload would make the global model NaN or infinite for every worker."""
    flags = np.empty(FINITE_BLOCK, dtype=bool)
    for name, arr in tensors.items():
        flat = np.asarray(arr).reshape(-1)
        for start in range(0, flat.size, FINITE_BLOCK):
            block = flat[start:start + FINITE_BLOCK]
            if not np.isfinite(block, out=flags[: block.size]).all():
                raise UploadRejected(Rejection.NON_FINITE, f"{who}: tensor {name!r} contains NaN or Inf")
            if block.size and np.max(np.abs(block)) > limit:
                raise UploadRejected(Rejection.OUT_OF_RANGE,
                                     f"{who}: tensor {name!r} holds {float(np.max(np.abs(block))):.3g}, beyond the "
                                     f"job's bound of {limit:.3g} on an update's values (aggregation.max_update_value)")
