"""A secure round of a job with `privacy.distributed`: one federated DP-SGD step inside secure aggregation.

Each survivor masked γ·(its sum of clipped per-record gradients), rounded, plus its own Skellam noise; the
unmasked sum is read back signed (`fedbroker.secagg.server.ddp_sum`) and the service takes the step
x ← x − lr·sum/(q·Σ n_j), n_j the survivors' declared record counts (q·Σ n_j is the expected size of the round's
Poisson batch, so the step is DP-SGD's mean gradient; the noise is in the sum already).

What this module adds to a secure round, beside `secure_rounds` (which calls it): the round's settings
(`session_settings`: the ring, γ and quorum from the job, the participants, the model and their registered
records, the same `ddp_round_params` each worker derives), the check of each worker's declared noise variance
(`check_noise_variance`: refused, naming the field, unless finite, at least its share of the quorum's dose and at
most what the ring was sized for per site), the settings the worker compares with its own (`sec_params`), and the
close (`combine_ddp`): below the quorum the round fails before anything is unmasked (a sum of fewer survivors
would carry less noise than promised), else it steps and writes the round's record (`fedbroker.secagg.ddp_record`).
The service never sees a site's noise, only its claim: what a site or the service could do with a false one is in
deploy/SECURITY.md ("Distributed DP: the service").
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

import numpy as np

from fedbroker.aggregators.combine import Combined
from fedbroker.aggregators.job_state import Round
from fedbroker.aggregators.mean import Layout
from fedbroker.aggregators.secure_session import SecureSession, refused
from fedbroker.close_report import SelectionRecord
from fedbroker.errors import ConfigError, Rejection, UploadRejected
from fedbroker.job.privacy import DistributedDP
from fedbroker.job.spec import ModelSpec, parameter_shapes
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.secagg.ddp_record import DDPRecord
from fedbroker.secagg.secure_round import ddp_round_params
from fedbroker.secagg.skellam import DDPRound

FIELD = "SecAdvertiseRequest.noise_variance"


def session_settings(distributed: DistributedDP, participants: Collection[str], spec: ModelSpec,
                     limits: Mapping[str, int]) -> tuple[DDPRound, int]:
    """(the round's DDP settings, the records they are sized for): the participants' registered counts summed.

    A participant without a registered count cannot be sized for: refused (the coordinator sends every count)."""
    missing = sorted(set(participants) - set(limits))
    if missing:
        raise UploadRejected(Rejection.BAD_REQUEST, f"a distributed-DP round needs every participant's registered "
                                                    f"record count; none for {missing}")
    records = sum(int(limits[w]) for w in participants)
    try:
        ddp = ddp_round_params(participants=len(participants), distributed=distributed,
                               dimension=Layout(parameter_shapes(spec)).size, records=records)
    except ConfigError as exc:
        raise UploadRejected(Rejection.BAD_REQUEST, str(exc)) from exc
    return ddp, records


def variance_limits(ddp: DDPRound) -> tuple[float, float]:
    """(least, most) a worker may declare: its share of the dose (less would leave a quorum short of it), and the
    most the ring was sized for per site (more could wrap the sum)."""
    return ddp.share_variance, ddp.max_share_variance or ddp.full_variance


def check_noise_variance(worker_id: str, declared: float, ddp: DDPRound | None) -> float:
    """The declared variance, refused (BAD_HEADER, naming the field) unless a finite number within the limits; in
    a plain secure round only 0 (a worker adding noise the service does not expect runs other settings)."""
    if ddp is None:
        if declared != 0:
            raise UploadRejected(Rejection.BAD_HEADER, f"worker {worker_id!r}: {FIELD} {declared!r} in a secure "
                                                       f"round without privacy.distributed (it must be 0): the "
                                                       f"worker runs other settings than the job's")
        return 0.0
    least, most = variance_limits(ddp)
    if not (isinstance(declared, (int, float)) and math.isfinite(declared)):
        raise UploadRejected(Rejection.BAD_HEADER, f"worker {worker_id!r}: {FIELD} must be a finite number, got "
                                                   f"{declared!r}")
    if not least * (1 - 1e-9) <= declared <= most:
        raise UploadRejected(Rejection.BAD_HEADER, f"worker {worker_id!r}: {FIELD} {declared:.6g} is outside "
                                                   f"[{least:.6g}, {most:.6g}] (its share of the quorum's noise .. "
                                                   f"the most the round's ring was sized for)")
    return float(declared)


def sec_params(session: SecureSession, params: pb.SecParams) -> pb.SecParams:
    """`params` with the session's distributed-DP fields (9..12) set (left 0 in a plain secure round)."""
    if session.ddp is not None:
        params.ddp_scale, params.ddp_bits = session.ddp.scale, session.ddp.bits
        params.ddp_quorum, params.ddp_records = session.quorum, session.records
    return params


def combine_ddp(rnd: Round, current: Mapping[str, np.ndarray], spec: ModelSpec, *, unmask_s: float) -> Combined:
    """Unmask the survivors' noisy gradient sum and take the DP-SGD step; below the quorum the round fails first."""
    session = rnd.secure
    assert isinstance(session, SecureSession) and session.ddp is not None  # never grouped: the job refuses both
    installed = rnd.algorithms.installed
    distributed, lr = installed.privacy.distributed, float(installed.training.lr)
    session.decide()  # refuses (the round fails, its waiters told) below the quorum: nothing is unmasked
    result = session.finish(wait_s=unmask_s)
    records = sum(session.weights[w][0] for w in result.survivors)
    variances = {w: session.noise[w] for w in result.survivors}
    record = DDPRecord(bits=session.ddp.bits, scale=session.ddp.scale, wrap_bound=session.ddp.wrap_probability,
                       quorum=session.quorum, noise_multiplier=distributed.noise_multiplier, clip=distributed.clip,
                       sample_rate=distributed.sample_rate, lr=lr, dim=session.ddp.dim, records=records,
                       share_variance=session.ddp.share_variance,
                       total_variance=sum(variances.values()), quorum_variance=session.ddp.full_variance,
                       variances=variances)
    if records <= 0 or not record.conservative:  # each declared ≥ its share and ≥ quorum survivors: cannot happen
        raise refused(f"{session.where}: the survivors' noise ({record.total_variance:.6g}) is below the quorum's "
                      f"dose ({record.quorum_variance:.6g}) or they declared no records")
    layout = Layout(parameter_shapes(spec))
    step = result.total * (lr / (distributed.sample_rate * records))
    state = {name: (np.asarray(current[name], dtype=np.float64) - step[start:stop].reshape(shape)).astype(np.float32)
             for (name, shape), (start, stop) in zip(layout.shapes.items(), layout.offsets.values())}
    stats = {"accepted": float(len(rnd.accepted)), "aggregated": float(len(result.survivors)),
             "secure_dropped": float(len(result.dropped)), "secure_threshold": float(session.params.threshold),
             "secure_error_max": result.error_max * lr / (distributed.sample_rate * records), **record.to_stats()}
    n = np.array([float(session.weights[w][0]) for w in result.survivors])
    selection = SelectionRecord(method=rnd.algorithms.settings.selection.name, accepted=len(rnd.accepted),
                                chosen=len(result.survivors))
    return Combined(list(result.survivors), n / n.sum(), spec, state, stats, selection, [],
                    excluded=sorted(session.excluded))
