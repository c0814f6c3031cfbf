"""One secure round at the aggregation service (aggregation.secure): the SecAgg+ server's stages, made safe
for a network.

`fedbroker.secagg.SecAggServer` runs each stage once, in order, and refuses a repeat. Workers retry calls
(a lost reply, a restarted connection), so the session answers a repeat with the same content by the same
answer and refuses only a *different* second message (other keys, other shares). It also decides when a
stage ends: the roster once every participant advertised or at the key deadline, the inboxes once every
roster member shared or at the share deadline, the exclusions once every inbox holder checked its inbox (before
it trains) or at the verify deadline, the survivors when the round closes; the waits are long polls on one
condition.

A worker the protocol proves wrong is excluded and named (`excluded`): its share message was malformed or
failed at a recipient (before anyone trains), or a share it revealed at the close was not the one its dealer
committed to (its reply is refused; the sum is rebuilt from the honest replies when t remain). A round that
can no longer reach its threshold fails at once, and every waiting worker is answered with why: when
verification leaves too few, when the round's deadline passes with fewer than t masked uploads, or when the
coordinator abandons it.

What the session holds: public keys, the sealed shares it routes (opaque to it), the raw weights the
workers declared (their sample counts or ISH weights, which the service sees on every upload anyway), the
running masked sum (inside the SecAggServer: a masked input is added and dropped, never kept), then the
unmask shares it needs for the sum. Never an update in the clear; nothing of it is written to disk.

What it counts (`fedbroker.aggregators.metrics`): how the round ended (once), the participants that missed each
step as the step is fixed, and the close's unmasking seconds; counts and times of the protocol, never a value
that depends on what a worker sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from fedbroker.aggregators import metrics
from fedbroker.errors import Rejection, UploadRejected
from fedbroker.secagg import (
    Dishonest,
    PublicKeys,
    SecAggError,
    SecAggParams,
    SecAggResult,
    SecAggServer,
    UnmaskRequest,
)
from fedbroker.secagg.secure_round import (
    LONG_POLL_S,
    ROUND_LOST,
    UNMASK_WAIT_S,
    ddp_secagg_params,
    phase_deadlines,
    round_params,
    round_seed,
)
from fedbroker.secagg.skellam import DDPRound

_T = TypeVar("_T")


def refused(why: str) -> UploadRejected:
    """A secure step the round cannot take (late, a second different message, the round failed): final."""
    return UploadRejected(Rejection.SECURE_PROTOCOL, why)


@dataclass(frozen=True)
class Roster:
    """What one worker learns when the roster is fixed."""

    peers: dict[str, PublicKeys]
    scale: float      # its weight share: w_i / Σ_roster w_j
    size: int


class SecureSession:
    """One secure round's state at the service (see the module docstring). Thread-safe."""

    def __init__(self, *, job_id: str, round_number: int, version: int, participants: frozenset[str], length: int,
                 opened: float, deadline: float, clock: Callable[[], float], n: int = 0,
                 ddp: DDPRound | None = None, quorum: int = 0, records: int = 0) -> None:
        """`n`: the ring's size in inputs (default: the participants). `ddp`: a distributed-DP round's settings
        (`fedbroker.aggregators.secure_ddp`): its ring is theirs, and each worker declares its noise variance.
        `quorum`: the fewest masked inputs the sum may be unmasked with (distributed DP: fewer carry less noise
        than the job promised), when above the threshold. `records`: what the DDP ring is sized for."""
        self.where = f"secure round {round_number} of job {job_id!r}"
        self.participants = participants
        self.ddp, self.quorum, self.records = ddp, quorum, records
        self.params: SecAggParams = (round_params(n or len(participants)) if ddp is None
                                     else ddp_secagg_params(n or len(participants), ddp))
        self.seed = round_seed(job_id, round_number, version)
        self.length = length
        self.key_deadline, self.share_deadline, self.verify_deadline = phase_deadlines(opened, deadline)
        self.deadline = deadline
        self.clock = clock
        self._server = SecAggServer(self.params, self.seed, length=length, ddp=ddp)
        self._cond = threading.Condition()
        self._keys: dict[str, PublicKeys] = {}
        self.weights: dict[str, tuple[int, float]] = {}   # worker → (declared samples, raw weight)
        self.noise: dict[str, float] = {}                  # distributed DP: worker → its declared noise variance
        self._rosters: dict[str, dict[str, PublicKeys]] | None = None
        self._sent: dict[str, dict[str, bytes]] = {}
        self._inboxes: dict[str, dict[str, bytes]] | None = None
        self._verdicts: dict[str, frozenset[str]] = {}     # inbox holder → the senders whose shares failed there
        self._masking: frozenset[str] | None = None        # who may mask, once the exclusions are fixed
        self.excluded: dict[str, str] = {}                 # worker → why the protocol excluded it (named)
        self.masked: set[str] = set()
        self._requests: dict[str, UnmaskRequest] | None = None
        self._replies: dict[str, dict[str, bytes]] = {}
        self.failed: str | None = None
        self.done = False                                  # the sum is unmasked: later unmask replies are not needed
        self.outcome: str | None = None                    # how the round ended (metrics.SECURE_OUTCOMES), once

    @classmethod
    def lost(cls, *, job_id: str, round_number: int, participants: frozenset[str], length: int) -> SecureSession:
        """A secure round a restarted service found in its spool: its keys and masked sum lived only in the
        memory of the service that died, so the round cannot be unmasked and every step is refused."""
        session = cls(job_id=job_id, round_number=round_number, version=0, participants=participants, length=length,
                      opened=0.0, deadline=0.0, clock=lambda: 0.0, n=max(len(participants), 2))
        session.failed = (f"the aggregation service restarted during {session.where} (or its replica died and "
                          f"another took the job over): {ROUND_LOST}, so the round cannot be unmasked")
        session._ended("lost")
        return session

    def of(self, worker_id: str) -> SecureSession:
        """The session a worker's steps go to: this one (a grouped round's `GroupedSession` picks its group's)."""
        return self

    def end(self, why: str) -> None:
        """The round ended without a close (a cancelled job's round was abandoned): every waiting worker is
        answered at once, with `why`, instead of at its deadline."""
        with self._cond:
            if self.failed is None:
                self.failed = f"{self.where} ended: {why}"
            self._ended("abandoned")
            self._cond.notify_all()

    # ----- keys -----

    def advertise(self, worker_id: str, keys: PublicKeys, samples: int, raw_weight: float,
                  noise_variance: float = 0.0) -> None:
        """Record a worker's public keys and declared weight (and noise variance, checked by the caller); the same
        advertisement again is a no-op."""
        with self._cond:
            self._check_alive()
            held = self._keys.get(worker_id)
            if held is not None:
                if held != keys or (self.weights[worker_id], self.noise.get(worker_id, 0.0)) != (
                        (samples, raw_weight), noise_variance):
                    raise refused(f"{self.where}: worker {worker_id!r} advertised other keys or another weight "
                                  f"before; a round takes one advertisement per worker")
                return
            if self._rosters is not None:
                raise refused(f"{self.where}: the roster was fixed before worker {worker_id!r} advertised")
            self._step(lambda: self._server.add_keys(worker_id, keys))
            self._keys[worker_id], self.weights[worker_id] = keys, (samples, raw_weight)
            if self.ddp is not None:
                self.noise[worker_id] = noise_variance
            if set(self._keys) >= self.participants:
                self._fix_roster()
            self._cond.notify_all()

    def roster(self, worker_id: str, wait_s: float) -> Roster | None:
        """The worker's peers and weight share once the roster is fixed; None while it is not (ask again)."""
        with self._cond:
            peers = self._fixed(lambda: self._rosters, worker_id, self.key_deadline, wait_s, self._fix_roster,
                                missing="is not on the roster (it advertised no keys in time)")
            if peers is None:
                return None
            assert self._rosters is not None  # fixed, as it held the worker's peers
            total = sum(self.weights[w][1] for w in self._rosters)
            return Roster(dict(peers), self.weights[worker_id][1] / total, len(self._rosters))

    def _fix_roster(self) -> None:
        self._dropped("keys", self.participants - set(self._keys))
        self._rosters = self._step(self._server.rosters)
        if sum(self.weights[w][1] for w in self._rosters) <= 0:
            self._fail("every worker on the roster declared weight 0: the round has no weighted mean")

    # ----- shares -----

    def share(self, worker_id: str, ciphertexts: Mapping[str, bytes]) -> None:
        """Route a worker's sealed shares; the same shares again are a no-op."""
        with self._cond:
            self._check_alive()
            if self._repeat(worker_id, self._sent.get(worker_id), dict(ciphertexts), what="shares"):
                return
            if self._rosters is None or self._inboxes is not None:
                raise refused(f"{self.where}: shares from worker {worker_id!r} outside the share phase")
            if worker_id in self.excluded:
                raise refused(f"{self.where}: worker {worker_id!r} was excluded: {self.excluded[worker_id]}")
            try:
                self._step(lambda: self._server.add_shares(worker_id, ciphertexts))
                self._sent[worker_id] = dict(ciphertexts)
            finally:  # a dealer excluded for malformed shares is through the share phase too: nobody waits for it
                if set(self._sent) | set(self.excluded) >= set(self._rosters):
                    self._fix_inboxes()
                self._cond.notify_all()

    def inbox(self, worker_id: str, wait_s: float) -> dict[str, bytes] | None:
        """The sealed shares peers sent the worker once the inboxes are fixed; None while they are not."""
        with self._cond:
            box = self._fixed(lambda: self._inboxes, worker_id, self.share_deadline, wait_s, self._fix_inboxes,
                              missing="sent no shares in time; it cannot mask")
            return None if box is None else dict(box)

    def _fix_inboxes(self) -> None:
        if self._rosters is None:
            self._fix_roster()
        assert self._rosters is not None
        self._dropped("shares", set(self._rosters) - set(self._sent))
        self._inboxes = self._step(self._server.inboxes)

    # ----- verification: each inbox holder opened its shares before training -----

    def verify(self, worker_id: str, failed: Mapping[str, str], wait_s: float) -> frozenset[str] | None:
        """Record which senders' shares failed at this worker (once; the same again is a no-op), then the
        senders excluded from the round once that is fixed (None while it is not). A worker excluded itself,
        or a round verification leaves below its threshold, is refused: it must not train."""
        with self._cond:
            self._check_alive()
            if self._inboxes is None or worker_id not in self._inboxes:
                raise refused(f"{self.where}: worker {worker_id!r} has no inbox to verify")
            held = self._verdicts.get(worker_id)
            if held is not None and held != frozenset(failed):
                raise refused(f"{self.where}: worker {worker_id!r} reported other failed shares before")
            if held is None and self._masking is None:
                unknown = sorted(set(failed) - set(self._inboxes[worker_id]))
                if unknown:
                    raise refused(f"{self.where}: worker {worker_id!r} reports shares from {unknown}, which sent it none")
                self._verdicts[worker_id] = frozenset(failed)
                for sender, why in sorted(failed.items()):
                    self.excluded.setdefault(sender, f"its shares failed at {worker_id!r} before training: {why}"[:300])
                if set(self._verdicts) >= set(self._inboxes):
                    self._fix_masking()
                self._cond.notify_all()
            if not self._wait(lambda: self._masking is not None, self.verify_deadline, wait_s, self._fix_masking):
                return None
            assert self._masking is not None
            if worker_id not in self._masking:
                raise refused(f"{self.where}: worker {worker_id!r} was excluded: "
                              f"{self.excluded.get(worker_id, 'it did not verify its inbox in time')}")
            return frozenset(self._inboxes) - self._masking

    def _fix_masking(self) -> None:
        assert self._inboxes is not None
        silent = set(self._inboxes) - set(self._verdicts)
        self._dropped("verify", silent)
        accused = {w for w in self.excluded if w in self._inboxes}
        self._masking = frozenset(set(self._inboxes) - silent - accused)
        self._step(lambda: self._server.exclude(silent | accused))

    # ----- masked inputs, survivors, unmasking -----

    def check_masked(self, worker_id: str, samples: int) -> None:
        """Whether this worker may upload a masked input now, declaring `samples` (as it advertised)."""
        with self._cond:
            self._check_alive()
            if self._masking is None or worker_id not in self._masking:
                raise refused(f"{self.where}: worker {worker_id!r} may not mask: "
                              f"{self.excluded.get(worker_id, 'it has no verified inbox')}")
            if self.weights[worker_id][0] != samples:
                raise UploadRejected(Rejection.BAD_HEADER, f"{self.where}: worker {worker_id!r} uploads for "
                                                           f"{samples} samples but advertised "
                                                           f"{self.weights[worker_id][0]}")

    def add_masked(self, worker_id: str, masked: np.ndarray) -> None:
        """Add a masked input to the running sum (the array is not kept)."""
        with self._cond:
            self._check_alive()
            self._step(lambda: self._server.add_masked(worker_id, masked))
            self.masked.add(worker_id)

    def decide(self) -> None:
        """The round closes: the survivors are the workers whose masked input is in the sum (idempotent)."""
        with self._cond:
            self._check_alive()
            if self._requests is None:
                if self._masking is None:
                    self._fail("the round closed before every participant had verified its shares")
                assert self._masking is not None
                self._dropped("upload", set(self._masking) - self.masked)
                if len(self.masked) < self.quorum:  # unmasked, the sum would carry less noise than promised
                    self._fail(f"{len(self.masked)} masked upload(s) arrived; the round's quorum is {self.quorum} "
                               f"(privacy.distributed: fewer would carry less noise than promised){self._named()}",
                               outcome="too_few_survivors")
                self._requests = self._step(self._server.unmask_requests)
            self._cond.notify_all()

    def survivors(self, worker_id: str, wait_s: float) -> UnmaskRequest | None:
        """Whose shares the worker must send, once the round closes; None while it is open."""
        with self._cond:
            return self._fixed(lambda: self._requests, worker_id, self.deadline, wait_s, self._check_reachable,
                               missing="is not a survivor (its masked input is not in the sum)")

    def unmask(self, worker_id: str, shares: Mapping[str, bytes]) -> None:
        """A survivor's shares; the same again is a no-op."""
        with self._cond:
            self._check_alive()
            if self._repeat(worker_id, self._replies.get(worker_id), dict(shares), what="unmask shares"):
                return
            if self.done:  # the sum was unmasked with the first t replies: this one is not needed (nor kept)
                return
            self._step(lambda: self._server.add_unmask(worker_id, shares))  # a cheat is named; the honest go on
            self._replies[worker_id] = dict(shares)
            self._cond.notify_all()

    def finish(self, *, wait_s: float = UNMASK_WAIT_S) -> SecAggResult:
        """Wait until every secret has its t shares (at most `wait_s`), then unmask the sum."""
        with self._cond:
            end, waited = self.clock() + wait_s, time.perf_counter()
            while not self._can_finish():
                self._check_alive()
                left = end - self.clock()
                if left <= 0:
                    self._unmask_dropped(waited)
                    self._fail(f"{len(self._replies)} survivor(s) sent valid unmask shares within {wait_s:g}s; "
                               f"{self.params.threshold} per secret are needed{self._named()}",
                               outcome="too_few_survivors")
                self._cond.wait(min(left, LONG_POLL_S))
            self._unmask_dropped(waited)
            started = time.perf_counter()
            result = self._step(self._server.finish)
            metrics.SECURE_UNMASK_SECONDS.labels("reconstruct").observe(time.perf_counter() - started)
            self._ended("closed")
            self.done = True
            self._replies.clear()
            return result

    def _can_finish(self) -> bool:
        if self._requests is None:
            return False
        counts: dict[str, int] = {}
        for replier in self._replies:
            request = self._requests[replier]
            for owner in request.survivors | request.dropped:
                counts[owner] = counts.get(owner, 0) + 1
        owners = set(self._requests) | {d for r in self._requests.values() for d in r.dropped}
        return all(counts.get(o, 0) >= self.params.threshold for o in owners)

    def _check_reachable(self) -> None:
        """At the round's deadline no masked upload can come: fewer than t in the sum fail the round now, so
        the workers waiting to unmask are told at once (not at the deadline plus the unmask wait)."""
        if self._requests is None and len(self.masked) < max(self.params.threshold, self.quorum):
            self._fail(f"the round's deadline passed with {len(self.masked)} masked upload(s); its threshold is "
                       f"{self.params.threshold}{f', its quorum {self.quorum}' if self.quorum else ''}"
                       f"{self._named()}", outcome="too_few_survivors")


    def _named(self) -> str:
        return "; excluded: " + "; ".join(f"{w} ({why})" for w, why in sorted(self.excluded.items())) \
            if self.excluded else ""

    def scale_sum(self, survivors: tuple[str, ...]) -> float:
        """Σ_survivors w_i / Σ_roster w_j: what the unmasked sum is divided by to give the weighted mean."""
        assert self._rosters is not None
        total = sum(self.weights[w][1] for w in self._rosters)
        return sum(self.weights[w][1] for w in survivors) / total

    # ----- helpers (under the condition) -----

    def _repeat(self, worker_id: str, held: object, sent: object, *, what: str) -> bool:
        """Whether `sent` repeats what the worker sent before (`held`; None: nothing yet), a retry answered as a
        no-op; other content than before is refused."""
        if held is None:
            return False
        if held != sent:
            raise refused(f"{self.where}: worker {worker_id!r} sent other {what} before")
        return True

    def _fixed(self, table: Callable[[], Mapping[str, _T] | None], worker_id: str, stage_deadline: float | None,
               wait_s: float, close_stage: Callable[[], None], *, missing: str) -> _T | None:
        """The worker's entry of a stage's `table` once the stage has fixed it (None while it has not: the
        long poll asks again); a worker the table leaves out is refused, saying why (`missing`)."""
        if not self._wait(lambda: table() is not None, stage_deadline, wait_s, close_stage):
            return None
        entry = (table() or {}).get(worker_id)
        if entry is None:
            raise refused(f"{self.where}: worker {worker_id!r} {missing}")
        return entry

    def _wait(self, done: Callable[[], bool], stage_deadline: float | None, wait_s: float,
              close_stage: Callable[[], None] | None) -> bool:
        """Wait for `done` at most `wait_s` (capped); past `stage_deadline` the waiter closes the stage itself."""
        end = self.clock() + max(0.0, min(wait_s, LONG_POLL_S))
        while True:
            self._check_alive()
            if done():
                return True
            now = self.clock()
            if stage_deadline is not None and now >= stage_deadline and close_stage is not None:
                close_stage()
                self._cond.notify_all()
                stage_deadline = None  # closed (or checked) once per call
                continue
            wake = end if stage_deadline is None else min(end, stage_deadline)
            if now >= end:
                return False
            self._cond.wait(max(wake - now, 0.01))

    def _step(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except Dishonest as exc:  # refused and named: the round goes on without it if its threshold holds
            self.excluded.setdefault(exc.worker_id, str(exc)[:300])
            raise refused(f"{self.where}: {exc}") from exc
        except SecAggError as exc:
            if exc.reason == "secagg_too_few_survivors":
                self._fail(str(exc), outcome="too_few_survivors")
            raise refused(f"{self.where}: {exc}") from exc

    def _fail(self, why: str, *, outcome: str = "failed") -> None:
        if self.excluded and "excluded:" not in why:
            why += self._named()
        self.failed = f"{self.where} failed: {why}"
        self._ended(outcome)
        self._cond.notify_all()
        raise refused(self.failed)

    def _ended(self, outcome: str) -> None:
        """Count how the round ended, the first time only (a failed round abandoned later stays failed)."""
        if self.outcome is None:
            self.outcome = outcome
            metrics.SECURE_ROUNDS.labels(outcome).inc()

    @staticmethod
    def _dropped(stage: str, workers: set[str] | frozenset[str]) -> None:
        if workers:
            metrics.SECURE_DROPPED.labels(stage).inc(len(workers))

    def _unmask_dropped(self, waited: float) -> None:
        """At the end of the close's wait: its seconds, and the survivors whose unmask shares had not come."""
        metrics.SECURE_UNMASK_SECONDS.labels("wait").observe(time.perf_counter() - waited)
        if self._requests is not None:
            self._dropped("unmask", set(self._requests) - set(self._replies))

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise refused(self.failed)

