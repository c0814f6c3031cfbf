"""Benchmark: a grouped secure + robust round (aggregation.secure_group_size 5, median over the group means)
against a plain secure round (one SecAgg+ sum of everyone, FedAvg) at the same N and P, in the same run.

Both rounds go through the aggregation service's own code in one process, driven as bench/secure_round.py
drives its secure round: the servicer's Sec* methods for the service, `SecAggClient`'s steps and
`weighted_vector` for each worker (one thread plays every worker), the masked uploads through
`RoundBook.receive_update`, the close. The only difference is the job's aggregation section: in the grouped
round each worker's roster, shares and masks are its group's (4 peers instead of N − 1), and the close
unmasks G sums and runs the median over the G group means. No dropout, no training, no spool. `all work`: the
service's and every worker's seconds summed; `in parallel`: the service's plus, per phase, the slowest
worker's (bench/secure_round.py's Clock).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat
from bench.secure_round import Clock, model, states
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.secure_groups import GroupedSession
from fedbroker.aggregators.service import AggregationServicer
from fedbroker.job.spec import ModelSpec
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.secagg import PublicKeys, SecAggClient, SecAggParams
from fedbroker.secagg.secure_round import round_seed
from fedbroker.worker.secure_task import weighted_vector

JOB = "bench-groups"
GROUP = 5
TARGET = 2.0


class _Context:
    """What the servicer's error path needs of a gRPC context."""

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")

    def set_trailing_metadata(self, metadata: Any) -> None:
        """Nothing to set."""


def one_round(spec: ModelSpec, ids: list[str], aggregation: dict[str, Any]) -> Clock:
    """One secure round (grouped when `aggregation` says so), every step timed by party and phase."""
    base, trained = states(spec, ids)
    book, clock, ctx = RoundBook(), Clock(), _Context()
    servicer = AggregationServicer(book)
    try:
        book.put_global(JOB, 1, spec.to_json(), base)
        version = book.open_round(JOB, 1, ids, time.time() + 3600, aggregation, seed=1,
                                  num_samples={w: 100 for w in ids})
        rnd = book.table.jobs[JOB].round
        assert rnd is not None and rnd.secure is not None
        secure = rnd.secure
        params: dict[str, SecAggParams] = {w: secure.of(w).params for w in ids}
        seed, rng = round_seed(JOB, 1, version), np.random.default_rng(7)

        def wait(w: str) -> pb.SecWaitRequest:
            return pb.SecWaitRequest(job_id=JOB, round=1, worker_id=w, wait_s=0.0)

        crypto = {w: clock.on(w, "keys", SecAggClient, w, params[w], seed, rng) for w in ids}
        for w in ids:
            keys = clock.on(w, "keys", crypto[w].advertise)
            clock.on("service", "keys", servicer.SecAdvertise, pb.SecAdvertiseRequest(
                job_id=JOB, round=1, worker_id=w, cipher_key=keys.c_pk, mask_key=keys.s_pk, num_samples=100), ctx)
        scales = {}
        for w in ids:
            roster = clock.on("service", "shares", servicer.SecRoster, wait(w), ctx)
            assert roster.ready
            scales[w] = roster.scale
            peers = {p.worker_id: PublicKeys(c_pk=p.cipher_key, s_pk=p.mask_key) for p in roster.peers}
            sealed = clock.on(w, "shares", crypto[w].share_keys, peers)
            clock.on("service", "shares", servicer.SecShare, pb.SecShareRequest(
                job_id=JOB, round=1, worker_id=w, ciphertexts=[pb.SecCiphertext(peer=p, data=d)
                                                               for p, d in sorted(sealed.items())]), ctx)
        _mask_and_upload(book, clock, servicer, ctx, crypto, scales, spec, base, trained, ids, wait)
        for session in secure.sessions if isinstance(secure, GroupedSession) else [secure]:
            clock.on("service", "unmask", session.decide)  # the close's first step (bench/secure_round.py)
        for w in ids:
            named = clock.on("service", "unmask", servicer.SecSurvivors, wait(w), ctx)
            shares = clock.on(w, "unmask", crypto[w].unmask, list(named.survivors), list(named.dropped))
            clock.on("service", "unmask", servicer.SecUnmask, pb.SecUnmaskRequest(
                job_id=JOB, round=1, worker_id=w, shares=[pb.SecShareValue(peer=p, share=s)
                                                          for p, s in sorted(shares.items())]), ctx)
        result = clock.on("service", "close", book.close, JOB, 1)
        assert len(result.aggregated) == len(ids)
        clock.result = book.global_model(JOB)[2]
    finally:
        book.stop()
    return clock


def _mask_and_upload(book: RoundBook, clock: Clock, servicer: AggregationServicer, ctx: _Context,
                     crypto: dict[str, SecAggClient], scales: dict[str, float], spec: ModelSpec,
                     base: dict[str, np.ndarray], trained: Any, ids: list[str], wait: Any) -> None:
    """Each worker opens its inbox and reports, then masks its weighted update and uploads it."""
    for w in ids:
        box = clock.on("service", "mask", servicer.SecInbox, wait(w), ctx)
        failed = clock.on(w, "mask", crypto[w].open_inbox, {c.peer: c.data for c in box.ciphertexts})
        clock.on("service", "mask", servicer.SecVerify, pb.SecVerifyRequest(
            job_id=JOB, round=1, worker_id=w, failed=[pb.SecComplaint(peer=p, reason=r) for p, r in failed.items()]),
            ctx)
    for w in ids:
        verdict = clock.on("service", "mask", servicer.SecVerify, pb.SecVerifyRequest(job_id=JOB, round=1,
                                                                                     worker_id=w), ctx)
        assert verdict.ready
        state = trained(w)
        masked = clock.on(w, "mask", lambda: np.ascontiguousarray(crypto[w].masked_input(
            weighted_vector(state, base, spec, scales[w]), verdict.excluded), dtype=crypto[w].params.dtype))
        tensors = {"masked": masked}
        header = pb.UpdateHeader(job_id=JOB, round=1, worker_id=w, num_samples=100,
                                 tensors=codec.tensor_specs(tensors), masked=True)
        messages = clock.on(w, "mask", lambda: list(codec.stream_messages(pb.UpdateChunk, header, tensors)))
        clock.on("service", "mask", book.receive_update, iter(messages))


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "secure_groups", "Secure and robust together: groups vs one secure sum",
        f"Seconds for one secure round of N workers × P parameters through the aggregation service's code in one "
        f"process, no training: `plain secure` (one SecAgg+ sum, FedAvg) against `grouped` (secure_group_size "
        f"{GROUP}: one SecAgg+ instance per group, the median over the group means). Target: grouped ≤ {TARGET:g}× "
        f"plain in all work, same run.")
    n, width = (20, 100) if quick else (20, 700)
    spec, ids = model(width), [f"w{i:02d}" for i in range(n)]
    p = width * width + width
    grouped = {"secure": True, "robust": "median", "secure_group_size": GROUP}
    one_round(model(8), ids, {"secure": True})  # imports and first calls: not timed
    one_round(model(8), ids, grouped)
    plains, groups = [], []
    for _ in range(2 if quick else 3):  # alternated, so both see the same load
        plains.append(one_round(spec, ids, {"secure": True}))
        groups.append(one_round(spec, ids, grouped))
    stats = {f"{kind} {part} (s)": Stat.of([getattr(c, attr)() if attr else c.service for c in clocks], "s")
             for kind, clocks in (("plain secure", plains), ("grouped", groups))
             for part, attr in (("all work", "total"), ("in parallel", "parallel"), ("service", ""))}
    ratios = {f"grouped / plain, {part}": stats[f"grouped {part} (s)"].median / stats[f"plain secure {part} (s)"].median
              for part in ("all work", "in parallel", "service")}
    section.rows.append({"N": n, "P": p, "groups": n // GROUP, **stats, **ratios})
    judged = not quick
    for name, value in ratios.items():
        met = (value <= TARGET if judged else None) if "all work" in name else None
        section.goals.append(Goal(f"{name} (N={n}, P={p}{'' if judged else ': quick, not judged'})", round(value, 2),
                                  f"≤ {TARGET:g}" if "all work" in name else "reported", met))
    section.seconds = time.perf_counter() - started
    return section
