"""Benchmark: a distributed-DP secure round (privacy.distributed) against a plain secure round, same run, same sizes.

Both rounds go through the aggregation service's own code in one process, as section 8 drives them (the servicer's
Sec* methods, the masked uploads through `RoundBook.receive_update`, the close), without training. What differs is
what each worker masks and what the close does with the sum: `plain secure` masks its weighted update (clipped and
quantised by the offset quantiser) and the close takes the weighted mean; `distributed DP` masks its gradient sum
scaled by γ, rounded and noised with its Skellam share (`fedbroker.secagg.skellam`: quantise, noise_share, to_ring;
`SecAggClient.masked_integers`), in the round's ring, and the close reads the sum back signed and takes one DP-SGD
step (`fedbroker.aggregators.secure_ddp`). The per-record gradients a real site computes are not here (a DP epoch
costs that in either mode); the gradient sum stands in as a random vector of the model's size.

Timed as section 8: `all work` (the service's and every worker's seconds summed), `in parallel` (the service's plus,
per phase, the slowest worker's) and `service` (the service's alone). 10 % of the workers drop after sharing keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat
from bench.secure_round import Clock, _Context, model, states
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import AggregationServicer
from fedbroker.job.settings import sections_settings
from fedbroker.job.spec import ModelSpec
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.secagg import PublicKeys, SecAggClient, skellam
from fedbroker.worker.secure_task import weighted_vector

JOB = "bench-ddp"
GOAL_N, TARGET = 50, 1.2
SAMPLES = 100  # each worker's records
PRIVACY = pb.DistributedDPSettings(enabled=True, noise_multiplier=1.0, clip=1.0, sample_rate=0.05, quorum=2)


def _install(book: RoundBook, spec: ModelSpec, base: dict[str, np.ndarray], ids: list[str], ddp: bool) -> None:
    settings = sections_settings(JOB, training={"lr": 0.1}, aggregation={"secure": True})
    if ddp:
        settings.privacy.distributed.CopyFrom(PRIVACY)
    book.installed.install(settings)
    book.put_global(JOB, 1, spec.to_json(), base)
    book.open_round(JOB, 1, ids, time.time() + 3600, seed=1, num_samples={w: SAMPLES for w in ids})


def one_round(spec: ModelSpec, base: dict[str, np.ndarray], trained: Callable[[str], dict[str, np.ndarray]],
              ids: list[str], dead: set[str], *, ddp: bool) -> Clock:
    """One secure round of `ids` (those in `dead` drop after sharing), plain or distributed DP."""
    book, clock, ctx = RoundBook(), Clock(), _Context()
    servicer = AggregationServicer(book)
    try:
        _install(book, spec, base, ids, ddp)
        rnd = book.table.jobs[JOB].round
        assert rnd is not None and rnd.secure is not None
        session = rnd.secure
        rng = np.random.default_rng(7)

        def wait(w: str) -> pb.SecWaitRequest:
            return pb.SecWaitRequest(job_id=JOB, round=1, worker_id=w, wait_s=0.0)

        crypto = {w: clock.on(w, "keys", SecAggClient, w, session.params, session.seed, rng) for w in ids}
        share = session.ddp.share_variance if session.ddp is not None else 0.0
        for w in ids:
            keys = clock.on(w, "keys", crypto[w].advertise)
            clock.on("service", "keys", servicer.SecAdvertise, pb.SecAdvertiseRequest(
                job_id=JOB, round=1, worker_id=w, cipher_key=keys.c_pk, mask_key=keys.s_pk, num_samples=SAMPLES,
                noise_variance=share), ctx)
        scales = {}
        for w in ids:
            roster = clock.on("service", "shares", servicer.SecRoster, wait(w), ctx)
            scales[w] = roster.scale
            peers = {p.worker_id: PublicKeys(c_pk=p.cipher_key, s_pk=p.mask_key) for p in roster.peers}
            sealed = clock.on(w, "shares", crypto[w].share_keys, peers)
            clock.on("service", "shares", servicer.SecShare, pb.SecShareRequest(
                job_id=JOB, round=1, worker_id=w, ciphertexts=[pb.SecCiphertext(peer=p, data=d)
                                                               for p, d in sorted(sealed.items())]), ctx)
        for w in ids:
            box = clock.on("service", "mask", servicer.SecInbox, wait(w), ctx)
            failed = clock.on(w, "mask", crypto[w].open_inbox, {c.peer: c.data for c in box.ciphertexts})
            clock.on("service", "mask", servicer.SecVerify, pb.SecVerifyRequest(
                job_id=JOB, round=1, worker_id=w, failed=[pb.SecComplaint(peer=p, reason=r) for p, r in failed.items()]),
                ctx)
        for w in (w for w in ids if w not in dead):
            verdict = clock.on("service", "mask", servicer.SecVerify, pb.SecVerifyRequest(job_id=JOB, round=1,
                                                                                           worker_id=w), ctx)
            state = trained(w)
            masked = clock.on(w, "mask", _masked, crypto[w], session, state, base, spec, scales[w], verdict.excluded,
                              np.random.default_rng(ids.index(w)))
            tensors = {"masked": masked}
            header = pb.UpdateHeader(job_id=JOB, round=1, worker_id=w, num_samples=SAMPLES,
                                     tensors=codec.tensor_specs(tensors), masked=True)
            messages = clock.on(w, "mask", lambda h=header, t=tensors: list(codec.stream_messages(pb.UpdateChunk, h, t)))
            clock.on("service", "mask", book.receive_update, iter(messages))
        clock.on("service", "unmask", session.decide)
        for w in (w for w in ids if w not in dead):
            named = clock.on("service", "unmask", servicer.SecSurvivors, wait(w), ctx)
            shares = clock.on(w, "unmask", crypto[w].unmask, list(named.survivors), list(named.dropped))
            clock.on("service", "unmask", servicer.SecUnmask, pb.SecUnmaskRequest(
                job_id=JOB, round=1, worker_id=w, shares=[pb.SecShareValue(peer=p, share=s)
                                                          for p, s in sorted(shares.items())]), ctx)
        result = clock.on("service", "close", book.close, JOB, 1)
        assert len(result.aggregated) == len(ids) - len(dead)
        clock.result = book.global_model(JOB)[2]
    finally:
        book.stop()
    return clock


def _masked(crypto: SecAggClient, session: Any, state: dict[str, np.ndarray], base: dict[str, np.ndarray],
            spec: ModelSpec, scale: float, excluded: Any, rng: np.random.Generator) -> np.ndarray:
    """What a worker masks: its weighted update (plain), or its γ-scaled, rounded, noised gradient sum (DDP)."""
    vector = weighted_vector(state, base, spec, scale)
    if session.ddp is None:
        return np.ascontiguousarray(crypto.masked_input(vector, excluded), dtype=session.params.dtype)
    ddp = session.ddp
    levels = skellam.quantise(vector, scale=ddp.scale, rng=rng)  # stands in for the clipped gradient sum
    levels += skellam.noise_share(rng, size=levels.shape[0], variance=ddp.share_variance)
    ring = skellam.to_ring(levels, bits=ddp.bits)
    return np.ascontiguousarray(crypto.masked_integers(ring, excluded, bits=ddp.bits), dtype=session.params.dtype)


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "ddp_round", "Distributed-DP secure round vs plain secure round (the service's path)",
        "Seconds for one secure round of N workers × P parameters through the aggregation service's code in one "
        "process, no training, no network, 10 % dropout: a plain secure round (weighted updates, offset quantiser, "
        "weighted mean) against a distributed-DP one (γ-scaled sums with each worker's Skellam share, the signed ring "
        "sum, one DP-SGD step). Same run, alternated, so both see the same load. `all work`, `in parallel` and "
        "`service` as in section 8.",
    )
    width, sizes = (100, (10,)) if quick else (1000, (GOAL_N,))
    spec = model(width)
    p = width * width + width
    warm = [f"w{i}" for i in range(4)]
    for ddp in (False, True):
        one_round(model(8), *states(model(8), warm), warm, set(), ddp=ddp)
    goal: dict[str, float] = {}
    for n in sizes:
        ids = [f"w{i:03d}" for i in range(n)]
        base, trained = states(spec, ids)
        dead = set(np.random.default_rng(n).choice(ids, round(0.1 * n), replace=False).tolist())
        plains, ddps = [], []
        for _ in range(2):
            plains.append(one_round(spec, base, trained, ids, dead, ddp=False))
            ddps.append(one_round(spec, base, trained, ids, dead, ddp=True))
        stats = {f"{kind} {part} (s)": Stat.of([getattr(c, attr)() if attr else c.service for c in clocks], "s")
                 for kind, clocks in (("plain secure", plains), ("distributed DP", ddps))
                 for part, attr in (("all work", "total"), ("in parallel", "parallel"), ("service", ""))}
        ratios = {f"DDP / plain secure, {part}": stats[f"distributed DP {part} (s)"].median
                  / stats[f"plain secure {part} (s)"].median for part in ("all work", "in parallel", "service")}
        section.rows.append({"N": n, "P": p, "dropout": "10%", **stats, **ratios})
        goal = ratios
    judged = not quick
    where = f"N={GOAL_N}, P≈1M, 10 % dropout" if judged else f"quick sizes N={sizes[-1]}, P={p}: not judged"
    for part in ("in parallel", "all work", "service"):
        name = f"DDP / plain secure, {part}"
        target = f"≤ {TARGET}" if part != "service" else "reported"
        met = (goal[name] <= TARGET if judged else None) if part != "service" else None
        section.goals.append(Goal(f"{name} ({where})", round(goal[name], 2), target, met))
    section.seconds = time.perf_counter() - started
    return section
