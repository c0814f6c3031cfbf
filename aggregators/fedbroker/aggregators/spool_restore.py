"""A job as its spool records it, back in memory: what a restarted service (`restore_jobs`) and a replica taking a
job over (`restore_one`) load. The records themselves are `aggregators.spool`'s."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from fedbroker.aggregators.async_state import folded_from_record, new_async_state, restore_fields
from fedbroker.aggregators.job_state import Accepted, CloseResult, Job, Receipt, UpdateSummary, new_round
from fedbroker.aggregators.robust import memory_from_arrays
from fedbroker.aggregators.secure_session import SecureSession
from fedbroker.aggregators.spool import AlgorithmsFor, Spool, StoredJob, _read_npz
from fedbroker.aggregators.weighting.base import UpdateMeta
from fedbroker.close_report import SelectionRecord, Verdict
from fedbroker.errors import NotFound
from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.weights.plan import ModelPlan, all_shapes, trainable_shapes

log = logging.getLogger(__name__)


def restore_one(spool: Spool, job_id: str, algorithms_for: AlgorithmsFor) -> Job | None:
    """One job as committed (a replica taking it over), cleaned of what its record does not name; None when the
    spool holds no record of it yet. A record that does not restore is quarantined (None)."""
    stored = spool.load_job(job_id)
    if stored is None:
        return None
    try:
        job = restore_job(spool, stored, algorithms_for)
    except Exception as exc:
        spool.quarantine(stored.folder, exc, job_id)
        return None
    with spool._writing(f"the cleanup of {stored.folder}", job_id):
        spool._prune(job.job_id, stored.folder, stored.record)
        spool._sweep(stored.folder)
    return job


def restore_job(spool: Spool, stored: StoredJob, algorithms_for: AlgorithmsFor) -> Job:
    """A job as committed, with its open round refilled from the spooled updates in their acceptance order."""
    record = stored.record
    versions = {v: tensors for v, (_, tensors) in stored.globals.items()}
    specs = {v: spec_json for v, (spec_json, _) in stored.globals.items()}
    try:  # what the job trains (fedbroker.weights): its global models hold adapters, its updates a subset
        plan = algorithms_for(record["job_id"], None).installed.plan
    except NotFound:
        plan = ModelPlan()
    for v, tensors in versions.items():
        _check_tensors(tensors, all_shapes(parse_model(json.loads(specs[v])), plan))
    job = Job(record["job_id"], parse_model(json.loads(specs[max(specs)])), int(record["seed"]), versions, specs,
              closed_rounds={int(n) for n in record["closed_rounds"]},
              closed_accepted={int(n): list(w) for n, w in record.get("closed_accepted", {}).items()},
              closed_deadlines={int(n): float(d) for n, d in record.get("closed_deadlines", {}).items()},
              closed_receipts={int(n): {w: Receipt(record["job_id"], int(n), w, True, int(size), str(sha))
                                        for w, (size, sha) in kept.items()}
                               for n, kept in record.get("closed_receipts", {}).items()})
    job.site_clip = None if record.get("site_clip") is None else float(record["site_clip"])
    if record.get("robust") is not None:  # a damaged file fails the job's restore: quarantined, as a global's
        job.robust_memory = memory_from_arrays(*_read_npz(spool.folder(job.job_id) / f"robust-{int(record['robust'])}.npz"))
    last = record.get("last_close")
    if last:
        job.last_close = (int(last["round"]), CloseResult(
            int(last["model_version"]), list(last["aggregated"]), last["model_spec_json"],
            {k: float(v) for k, v in last["stats"].items()}, float(last["seconds"]),
            [UpdateSummary(**u) for u in last["updates"]],
            SelectionRecord(**last["selection"]) if last.get("selection") else None,
            [Verdict(**v) for v in last.get("verdicts", [])], [str(w) for w in last.get("excluded", [])]))
    r = record.get("round")
    if r:
        aggregation = dict(r["aggregation"])
        job.round = new_round(int(r["number"]), frozenset(r["participants"]), float(r["deadline"]),
                              algorithms_for(job.job_id, aggregation), aggregation,
                              {w: list(h) for w, h in r["histograms"].items()}, job.spec,
                              sample_limits={w: int(n) for w, n in (r.get("num_samples") or {}).items()})
        shapes = trainable_shapes(job.spec, plan)
        if aggregation.get("secure"):  # its keys and masked sum were in the dead service's memory only
            job.round.secure = SecureSession.lost(job_id=job.job_id, round_number=job.round.number,
                                                  participants=job.round.participants, length=0)
            log.warning("job %s: %s", job.job_id, job.round.secure.failed)
        for path, meta, tensors in spool.updates(stored, job.round.number):
            try:
                entry = _accepted_from_record(meta)
                seq = int(meta["seq"])
                _check_tensors(tensors, shapes)
            except Exception as exc:  # a damaged update: quarantined, the round goes on with the others
                spool.quarantine(path, exc)
                continue
            job.round.next_seq = seq + 1
            job.round.accept(entry, tensors, None)
        log.info("job %s: round %d reopened with %d accepted update(s) from the spool", job.job_id,
                 job.round.number, len(job.round.accepted))
    if record.get("async"):
        _restore_async(spool, stored, job, record["async"], algorithms_for)
    return job


def _restore_async(spool: Spool, stored: StoredJob, job: Job, record: Mapping[str, Any],
                   algorithms_for: AlgorithmsFor) -> None:
    """The async state as committed, its buffer refilled by replaying the spooled updates in acceptance order
    (the buffer sums in that order, so the next version is the one the service would have published)."""
    config = dict(record["config"])
    state = new_async_state(config, {w: int(n) for w, n in record["num_samples"].items()},
                            algorithms_for(job.job_id, config.get("aggregation")))
    restore_fields(state, record)
    shapes = parameter_shapes(job.spec)
    for path, meta, tensors in spool.updates(stored, job.version, kind="buffer"):
        try:
            entry = folded_from_record(meta)
            _check_tensors(tensors, shapes)
            base = job.versions[entry.base]
        except Exception as exc:  # a damaged update: quarantined, the buffer goes on with the others
            spool.quarantine(path, exc)
            continue
        state.fold(entry, tensors, base)
    job.asynchronous = state
    if state.folded:
        log.info("job %s: asynchronous buffer on version %d reopened with %d update(s) from the spool", job.job_id,
                 job.version, len(state.folded))


def restore_jobs(spool: Spool, algorithms_for: AlgorithmsFor) -> Iterator[Job]:
    """Every job the spool holds, restored; a job whose record or global models do not load or restore is
    quarantined (`Spool.quarantine`), so one damaged record never stops the service or another job."""
    for stored in spool.load():
        try:
            job = restore_job(spool, stored, algorithms_for)
        except Exception as exc:
            spool.quarantine(stored.folder, exc)
            continue
        with spool._writing(f"the cleanup of {stored.folder}"):
            spool._prune(job.job_id, stored.folder, stored.record)
            spool._sweep(stored.folder)
        yield job


def _check_tensors(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """An update file holds exactly the model's float32 tensors (it was checked on arrival; a file may rot)."""
    got = {name: tuple(arr.shape) for name, arr in tensors.items()}
    if got != {name: tuple(shape) for name, shape in shapes.items()}:
        raise ValueError(f"its tensors {got} are not the model's {dict(shapes)}")
    for name, arr in tensors.items():
        if arr.dtype != np.float32:
            raise ValueError(f"tensor {name!r} is {arr.dtype}, not float32")


def _accepted_from_record(r: Mapping[str, Any]) -> Accepted:
    meta = UpdateMeta(worker_id=r["worker_id"], num_samples=int(r["num_samples"]), ish=r["ish"], loss=r["loss"])
    return Accepted(r["worker_id"], int(r["num_samples"]), float(r["raw_weight"]), r["sha256"],
                    int(r["bytes_received"]), meta, epsilon=float(r["epsilon"]), train_loss=float(r["train_loss"]))
