"""Benchmark 8: a secure round against a plain round, both through the aggregation service's own code, in one
process, without training.

`plain`: N workers' updates streamed into `RoundBook.receive_update` (`fedbroker.rpc.codec.stream_messages`, as
experiments/harness.py uploads), then `RoundBook.close` (FedAvg). `secure`: the same round with
`aggregation: {secure: true}` through the objects the gRPC servicer uses, called in process: the servicer's
six Sec* methods (advertise, roster, shares, inbox, survivors, unmask), the masked upload through
`receive_update`, the close. The workers' side is what `fedbroker.worker.secure_task.SecureRun` does
(`SecAggClient`'s four steps, `weighted_vector`), driven step by step so one thread plays every worker; the
close's first step (naming the survivors, `SecureSession.decide`) is called just before the workers' unmask
step, where a deployment's close calls it and then waits for their shares. No spool on either side.

Each round is timed in two parts: the service's seconds and each worker's seconds per phase. `all work` is
their sum (the CPU a round costs, every worker in one queue); `workers in parallel` is the service's seconds
plus, per phase, the slowest worker (what a round takes when each worker runs on its own machine). Dropped
workers (10 %) advertise and share keys, then send nothing; in the plain round they do not upload.
What a real round adds: each worker's DP training, measured here as one local epoch of a 1.2 M-parameter
ResNet-style CNN (bench section 6's model) on 512 samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.secure_groups import GroupedSession
from fedbroker.aggregators.service import AggregationServicer
from fedbroker.job.spec import ModelSpec, parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.secagg import PublicKeys, SecAggClient, sum_error_bound
from fedbroker.secagg.secure_round import round_params
from fedbroker.worker.secure_task import weighted_vector

JOB = "bench-round"
GOAL_N, GOAL_DROPOUT = 50, 0.1


class _Context:
    """What `fedbroker.rpc.plumbing.handle` needs of a gRPC context: only an error touches it."""

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


class Clock:
    """Seconds of the service and of each worker in each phase; the round's new global model."""

    def __init__(self) -> None:
        self.service = 0.0
        self.workers: dict[str, dict[str, float]] = {}
        self.result: dict[str, np.ndarray] = {}

    def on(self, who: str, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        took = time.perf_counter() - t0
        if who == "service":
            self.service += took
        else:
            per = self.workers.setdefault(phase, {})
            per[who] = per.get(who, 0.0) + took
        return out

    def total(self) -> float:
        return self.service + sum(sum(p.values()) for p in self.workers.values())

    def parallel(self) -> float:
        return self.service + sum(max(p.values()) for p in self.workers.values())


def model(width: int) -> ModelSpec:
    """One Linear layer width → width: width² + width parameters."""
    return parse_model({"input_shape": [width], "layers": [{"type": "Linear", "in_features": width,
                                                            "out_features": width}]})


def states(spec: ModelSpec, ids: list[str]) -> tuple[dict[str, np.ndarray], Callable[[str], dict[str, np.ndarray]]]:
    """The global model, and each worker's trained model (made on demand, outside the timed parts)."""
    from fedbroker.job.spec import parameter_shapes

    shapes = parameter_shapes(spec)
    rng = np.random.default_rng(0)
    base = {n: rng.normal(scale=0.1, size=s).astype(np.float32) for n, s in shapes.items()}

    def trained(worker: str) -> dict[str, np.ndarray]:
        r = np.random.default_rng(ids.index(worker) + 1)
        return {n: (a + r.normal(scale=0.01, size=a.shape)).astype(np.float32) for n, a in base.items()}

    return base, trained


def _open(book: RoundBook, spec: ModelSpec, base: dict[str, np.ndarray], ids: list[str],
          aggregation: dict[str, Any]) -> int:
    book.put_global(JOB, 1, spec.to_json(), base)
    return book.open_round(JOB, 1, ids, time.time() + 3600, aggregation, seed=1, num_samples={w: 100 for w in ids})


def _upload(book: RoundBook, clock: Clock, worker: str, header: pb.UpdateHeader, tensors: dict[str, np.ndarray],
            phase: str) -> None:
    messages = clock.on(worker, phase, lambda: list(codec.stream_messages(pb.UpdateChunk, header, tensors)))
    clock.on("service", phase, book.receive_update, iter(messages))


def plain_round(spec: ModelSpec, base: dict[str, np.ndarray], trained: Callable[[str], dict[str, np.ndarray]],
                ids: list[str], dead: set[str]) -> Clock:
    book, clock = RoundBook(), Clock()
    try:
        _open(book, spec, base, ids, {})
        for w in ids:
            if w not in dead:
                state = trained(w)
                header = pb.UpdateHeader(job_id=JOB, round=1, worker_id=w, num_samples=100,
                                         tensors=codec.tensor_specs(state))
                _upload(book, clock, w, header, state, "upload")
        result = clock.on("service", "close", book.close, JOB, 1)
        assert len(result.aggregated) == len(ids) - len(dead)
        clock.result = book.global_model(JOB)[2]
    finally:
        book.stop()
    return clock


Mask = Callable[[Any, str, SecAggClient, np.ndarray, Any], np.ndarray]


def masked_update(session: Any, worker: str, client: SecAggClient, vector: np.ndarray, excluded: Any) -> np.ndarray:
    """What a plain secure worker masks: its weighted update (clipped and quantised by the offset quantiser)."""
    return client.masked_input(vector, excluded)


def drive_secure_round(book: RoundBook, clock: Clock, spec: ModelSpec, base: dict[str, np.ndarray],
                       trained: Callable[[str], dict[str, np.ndarray]], ids: list[str], dead: set[str], *,
                       job: str, mask: Mask = masked_update, samples: int = 100) -> None:
    """Every step of round 1 of `job` (already open in `book`, secure), timed by party and phase, then its close:
    the servicer's Sec* methods for the service, each worker's `SecAggClient` steps (one thread plays them all),
    the masked uploads through `receive_update`. Workers in `dead` drop after sharing keys. Each worker's round
    parameters come from its session (a group's when the round is grouped); `mask` says what it masks of its
    weighted update. The shared driver of sections 8, secure_groups and ddp_round, so they time the same steps."""
    ctx, servicer = _Context(), AggregationServicer(book)
    rnd = book.table.jobs[job].round
    assert rnd is not None and rnd.secure is not None
    secure = rnd.secure
    rng = np.random.default_rng(7)

    def wait(w: str) -> pb.SecWaitRequest:
        return pb.SecWaitRequest(job_id=job, round=1, worker_id=w, wait_s=0.0)

    crypto = {w: clock.on(w, "keys", SecAggClient, w, secure.of(w).params, secure.seed, rng) for w in ids}
    for w in ids:
        keys = clock.on(w, "keys", crypto[w].advertise)
        ddp = secure.of(w).ddp
        clock.on("service", "keys", servicer.SecAdvertise, pb.SecAdvertiseRequest(
            job_id=job, round=1, worker_id=w, cipher_key=keys.c_pk, mask_key=keys.s_pk, num_samples=samples,
            noise_variance=ddp.share_variance if ddp is not None else 0.0), ctx)
    scales = {}
    for w in ids:
        roster = clock.on("service", "shares", servicer.SecRoster, wait(w), ctx)
        assert roster.ready
        scales[w] = roster.scale
        peers = {p.worker_id: PublicKeys(c_pk=p.cipher_key, s_pk=p.mask_key) for p in roster.peers}
        sealed = clock.on(w, "shares", crypto[w].share_keys, peers)
        clock.on("service", "shares", servicer.SecShare, pb.SecShareRequest(
            job_id=job, round=1, worker_id=w, ciphertexts=[pb.SecCiphertext(peer=p, data=d)
                                                           for p, d in sorted(sealed.items())]), ctx)
    for w in ids:  # each opens its inbox and reports (the last report fixes the exclusions)
        box = clock.on("service", "mask", servicer.SecInbox, wait(w), ctx)
        failed = clock.on(w, "mask", crypto[w].open_inbox, {c.peer: c.data for c in box.ciphertexts})
        clock.on("service", "mask", servicer.SecVerify, pb.SecVerifyRequest(
            job_id=job, round=1, worker_id=w, failed=[pb.SecComplaint(peer=p, reason=r) for p, r in failed.items()]),
            ctx)
    alive = [w for w in ids if w not in dead]
    for w in alive:
        verdict = clock.on("service", "mask", servicer.SecVerify, pb.SecVerifyRequest(job_id=job, round=1,
                                                                                       worker_id=w), ctx)
        assert verdict.ready
        state = trained(w)
        masked = clock.on(w, "mask", lambda: np.ascontiguousarray(mask(
            secure.of(w), w, crypto[w], weighted_vector(state, base, spec, scales[w]), verdict.excluded),
            dtype=crypto[w].params.dtype))
        tensors = {"masked": masked}
        header = pb.UpdateHeader(job_id=job, round=1, worker_id=w, num_samples=samples,
                                 tensors=codec.tensor_specs(tensors), masked=True)
        _upload(book, clock, w, header, tensors, "mask")
    for session in secure.sessions if isinstance(secure, GroupedSession) else [secure]:
        clock.on("service", "unmask", session.decide)  # the close's first step (see the module docstring)
    for w in alive:
        named = clock.on("service", "unmask", servicer.SecSurvivors, wait(w), ctx)
        shares = clock.on(w, "unmask", crypto[w].unmask, list(named.survivors), list(named.dropped))
        clock.on("service", "unmask", servicer.SecUnmask, pb.SecUnmaskRequest(
            job_id=job, round=1, worker_id=w, shares=[pb.SecShareValue(peer=p, share=s)
                                                      for p, s in sorted(shares.items())]), ctx)
    result = clock.on("service", "close", book.close, job, 1)
    assert len(result.aggregated) == len(alive)
    clock.result = book.global_model(job)[2]


def secure_round(spec: ModelSpec, base: dict[str, np.ndarray], trained: Callable[[str], dict[str, np.ndarray]],
                 ids: list[str], dead: set[str]) -> Clock:
    book, clock = RoundBook(), Clock()
    try:
        _open(book, spec, base, ids, {"secure": True})
        drive_secure_round(book, clock, spec, base, trained, ids, dead, job=JOB)
    finally:
        book.stop()
    return clock


def dp_epoch_seconds(samples: int) -> float:
    """One DP local epoch (Opacus DP-SGD, automatic clipping, batch 64, 1 torch thread) of section 6's
    ResNet-style CNN on `samples` synthetic 28×28 inputs, after one warm-up epoch."""
    import torch

    from bench.dp_training import resnet_gn
    from fedbroker.config import DPPolicy
    from fedbroker.job.spec import TrainingConfig
    from fedbroker.worker.clipping import clipping_mode
    from fedbroker.worker.training import train_local

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = resnet_gn()
        rng = np.random.default_rng(0)
        x = rng.normal(size=(samples, 1, 28, 28)).astype(np.float32)
        y = rng.integers(0, 10, size=samples)
        config = TrainingConfig(local_epochs=1, batch_size=64, lr=0.05)
        policy = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1e9)
        mode = clipping_mode(net, expected_batch_size=64)
        seconds = []
        for seed in range(2):
            t0 = time.perf_counter()
            train_local(net, x, y, config=config, dp=policy, seed=seed, device="cpu", clipping=mode)
            seconds.append(time.perf_counter() - t0)
        return seconds[-1]
    finally:
        torch.set_num_threads(threads)


def _ratio(secure: Stat, plain: Stat) -> float:
    return secure.median / plain.median


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "secure_round", "8. Secure round vs plain round (the service's path)",
        "Seconds for one round of N workers × P parameters through the aggregation service's code in one process, "
        "no training, no network: plain (each update streamed into RoundBook.receive_update, then close) against "
        "secure (the servicer's Sec* methods, the masked uploads through receive_update, the close). `all work`: the "
        "service's and every worker's seconds summed; `in parallel`: the service's plus, per protocol phase, the "
        "slowest worker's; `service`: the service's alone. `+ DP epoch`: the in-parallel ratio once each worker "
        "also trains one DP epoch (below). `model gap`: the largest difference between the two rounds' new "
        "models, against the secure sum's quantisation bound.",
    )
    width, sizes = (100, (5, 10)) if quick else (1000, (10, 50, 100))
    spec = model(width)
    p = width * width + width
    dp_samples = 64 if quick else 512
    epoch = dp_epoch_seconds(dp_samples)
    section.notes.append(f"One DP local epoch of section 6's ResNet-style CNN (1,209,834 parameters, Opacus DP-SGD, "
                         f"automatic clipping, batch 64, 1 torch thread) on {dp_samples} samples took {epoch:.2f} s "
                         f"here; a site's epoch over its whole data set takes that × its samples / {dp_samples}")
    section.notes.append("Both rounds run without a spool (`aggregator.spool_dir` unset): with one, the plain round "
                         "also writes each update to disk before its receipt, the secure round writes none")
    warm = [f"w{i}" for i in range(4)]  # imports, first allocations, the ciphers' first calls: not timed
    plain_round(model(8), *states(model(8), warm), warm, set())
    secure_round(model(8), *states(model(8), warm), warm, set())
    goal: dict[str, float] = {}
    for n in sizes:
        ids = [f"w{i:03d}" for i in range(n)]
        base, trained = states(spec, ids)
        rng = np.random.default_rng(n)
        for dropout in (0.0, 0.1):
            dead = set(rng.choice(ids, round(dropout * n), replace=False).tolist()) if dropout else set()
            reps = 2 if quick or n > 50 else 3
            plains, secures = [], []
            for _ in range(reps):  # alternated, so both see the same load
                plains.append(plain_round(spec, base, trained, ids, dead))
                secures.append(secure_round(spec, base, trained, ids, dead))
            gap = max(float(np.abs(secures[0].result[k] - plains[0].result[k]).max()) for k in plains[0].result)
            alive = n - len(dead)  # equal weights: the service divides the unmasked sum by alive / n
            bound = sum_error_bound(round_params(n), alive)[0] * n / alive
            assert gap <= bound + 1e-6, f"N={n}: the secure round's model is {gap} from the plain round's ({bound})"
            stats = {f"{kind} {part} (s)": Stat.of([getattr(c, attr)() if attr else c.service for c in clocks], "s")
                     for kind, clocks in (("plain", plains), ("secure", secures))
                     for part, attr in (("all work", "total"), ("in parallel", "parallel"), ("service", ""))}
            par = (stats["secure in parallel (s)"].median + epoch) / (stats["plain in parallel (s)"].median + epoch)
            ratios = {"secure / plain, all work": _ratio(stats["secure all work (s)"], stats["plain all work (s)"]),
                      "secure / plain, in parallel": _ratio(stats["secure in parallel (s)"],
                                                            stats["plain in parallel (s)"]),
                      "secure / plain, service": _ratio(stats["secure service (s)"], stats["plain service (s)"]),
                      "secure / plain, in parallel + DP epoch": par}
            section.rows.append({"N": n, "P": p, "dropout": f"{dropout:.0%}", **stats, **ratios,
                                 "model gap (max)": gap, "quantisation bound": bound})
            if n == (GOAL_N if not quick else sizes[-1]) and dropout == GOAL_DROPOUT:
                goal = ratios
    judged = not quick
    where = f"N={GOAL_N}, P≈1M, 10 % dropout" if judged else f"quick sizes N={sizes[-1]}, P={p}: not judged"
    for name, target in (("secure / plain, in parallel", "≤ 1.5"), ("secure / plain, all work", "≤ 1.5"),
                         ("secure / plain, in parallel + DP epoch", "≤ 1.5"), ("secure / plain, service", "reported")):
        met = (goal[name] <= 1.5 if judged else None) if target != "reported" else None
        section.goals.append(Goal(f"{name} ({where})", round(goal[name], 2), target, met))
    section.seconds = time.perf_counter() - started
    return section
