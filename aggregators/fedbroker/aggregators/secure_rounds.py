"""The round book's secure rounds (aggregation.secure): each call finds the round's `SecureSession` and passes
the worker's message on, the masked upload goes into the session's running sum, and the close unmasks it.

Beside `round_book` (which calls `receive_masked` and `combine_secure`) so the book stays the thin coordinator
of its parts; the jobs and their locks come from its `JobTable`, the public collaborator the parts share.
What a secure round keeps: each accepted worker's receipt and declared weight (as any round), the session's
keys and routed shares, and the masked sum. It writes no update to the spool: a secure round's only durable
trace is the round's definition in job.json, and a service restarted on its spool refuses that round's every
step (`SecureSession.lost`), so its workers and then the coordinator see the round fail, by name, instead of
a sum that silently lost inputs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import numpy as np

from fedbroker.aggregators import secure_ddp
from fedbroker.aggregators.combine import Combined
from fedbroker.aggregators.job_state import Accepted, Receipt, Round
from fedbroker.aggregators.job_table import JobTable, receiving
from fedbroker.aggregators.mean import Layout
from fedbroker.aggregators.secure_groups import GroupedSession, combine_grouped
from fedbroker.aggregators.secure_session import Roster, SecureSession, refused
from fedbroker.aggregators.weighting.base import UpdateMeta
from fedbroker.close_report import SelectionRecord
from fedbroker.errors import Rejection, UploadRejected
from fedbroker.job.privacy import DistributedDP
from fedbroker.job.spec import ModelSpec, parameter_shapes
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.secagg import PublicKeys, SecAggError, UnmaskRequest
from fedbroker.secagg.secure_round import WAITING_CALLS

T = TypeVar("T")
V = TypeVar("V")

log = logging.getLogger(__name__)


def new_session(job_id: str, round_number: int, version: int, participants: frozenset[str], spec: ModelSpec, *,
                opened: float, deadline: float, clock: Callable[[], float], group_size: int = 0,
                distributed: DistributedDP | None = None,
                limits: Mapping[str, int] | None = None) -> SecureSession | GroupedSession:
    """The session of a secure round being opened: one per group with aggregation.secure_group_size; with
    `distributed` (enabled), a distributed-DP round sized for the participants' registered record counts
    `limits` (`secure_ddp`). The job refuses both together."""
    if group_size:
        return GroupedSession(job_id=job_id, round_number=round_number, version=version, participants=participants,
                              length=Layout(parameter_shapes(spec)).size, opened=opened, deadline=deadline,
                              clock=clock, group_size=group_size)
    ddp, records = secure_ddp.session_settings(distributed, participants, spec, limits or {}) \
        if distributed is not None and distributed.enabled else (None, 0)
    return SecureSession(job_id=job_id, round_number=round_number, version=version, participants=participants,
                         length=Layout(parameter_shapes(spec)).size, opened=opened, deadline=deadline, clock=clock,
                         ddp=ddp, quorum=distributed.quorum if ddp is not None and distributed else 0, records=records)


class SecureRounds:
    """The secure calls of one round book (see the module docstring)."""

    def __init__(self, table: JobTable, *, unmask_s: float, waiting_calls: int = WAITING_CALLS) -> None:
        self.table = table
        self.unmask_s = unmask_s  # the close's wait for the survivors' unmask shares
        # The waiting calls (roster, inbox, survivors) hold a server thread each: at most `waiting_calls` at once,
        # so a large round's waiters never take the threads the coordinator's calls and the uploads need.
        self._waiting = threading.BoundedSemaphore(waiting_calls)

    @contextlib.contextmanager
    def _hold(self, wait_s: float) -> Iterator[float]:
        """How long this call may wait: `wait_s` while a waiting slot is free, else 0 (answered at once)."""
        held = self._waiting.acquire(blocking=False)
        try:
            yield wait_s if held else 0.0
        finally:
            if held:
                self._waiting.release()

    def _session(self, job_id: str, round_number: int, worker_id: str) -> tuple[Round, SecureSession]:
        job = self.table.job(job_id)
        with self.table.lock:
            rnd = job.current(round_number)
        if rnd is None:
            raise UploadRejected(Rejection.UNKNOWN_ROUND, f"round {round_number} of job {job_id!r} is not open")
        if rnd.secure is None:
            raise refused(f"round {round_number} of job {job_id!r} is not a secure round")
        if worker_id not in rnd.participants:
            raise UploadRejected(Rejection.UNKNOWN_WORKER,
                                 f"worker {worker_id!r} is not a participant of round {round_number}")
        return rnd, rnd.secure.of(worker_id)  # a grouped round: the worker's group's session

    def advertise(self, request: pb.SecAdvertiseRequest) -> SecureSession:
        """Record the worker's keys and declared weight (checked as an upload's header would be)."""
        rnd, session = self._session(request.job_id, request.round, request.worker_id)
        if rnd.closed:
            raise refused(f"round {request.round} of job {request.job_id!r} is closing: it takes no new keys")
        limit = rnd.sample_limits.get(request.worker_id)
        if request.num_samples <= 0 or (limit is not None and request.num_samples > limit):
            raise UploadRejected(Rejection.TOO_MANY_SAMPLES if request.num_samples > 0 else Rejection.BAD_HEADER,
                                 f"worker {request.worker_id!r} declares {request.num_samples} samples "
                                 f"(registered: {limit if limit is not None else 'unbounded'})")
        meta = UpdateMeta(worker_id=request.worker_id, num_samples=int(request.num_samples),
                          ish=request.ish if request.has_ish else None)
        try:
            raw = float(rnd.algorithms.weighting.raw_weight(meta))
            keys = PublicKeys(c_pk=bytes(request.cipher_key), s_pk=bytes(request.mask_key))
        except (ValueError, SecAggError) as exc:
            raise UploadRejected(Rejection.BAD_HEADER, f"worker {request.worker_id!r}: {exc}") from exc
        noise = secure_ddp.check_noise_variance(request.worker_id, request.noise_variance, session.ddp) \
            if session.failed is None else 0.0  # a failed (or lost) round answers why it failed, below
        session.advertise(request.worker_id, keys, int(request.num_samples), raw, noise)
        return session

    def _wait(self, request: pb.SecWaitRequest, step: Callable[[SecureSession, str, float], T]) -> T:
        """One long poll of the worker's round: `step(session, worker, wait_s)` within the service's hold."""
        session = self._session(request.job_id, request.round, request.worker_id)[1]
        with self._hold(request.wait_s) as wait_s:
            return step(session, request.worker_id, wait_s)

    def roster(self, request: pb.SecWaitRequest) -> Roster | None:
        """The worker's peers and weight share, or None while the roster is not fixed."""
        return self._wait(request, SecureSession.roster)

    def share(self, request: pb.SecShareRequest) -> None:
        """Route the worker's sealed shares."""
        _, session = self._session(request.job_id, request.round, request.worker_id)
        ciphertexts = _one_each(request.worker_id, [(c.peer, bytes(c.data)) for c in request.ciphertexts])
        session.share(request.worker_id, ciphertexts)

    def inbox(self, request: pb.SecWaitRequest) -> dict[str, bytes] | None:
        """The sealed shares for the worker, or None while the inboxes are not fixed."""
        return self._wait(request, SecureSession.inbox)

    def verify(self, request: pb.SecVerifyRequest) -> frozenset[str] | None:
        """The senders whose shares failed at the worker in; the round's excluded senders out, None while open."""
        session = self._session(request.job_id, request.round, request.worker_id)[1]
        failed = _one_each(request.worker_id, [(c.peer, c.reason[:200]) for c in request.failed])
        with self._hold(request.wait_s) as wait_s:
            return session.verify(request.worker_id, failed, wait_s)

    def survivors(self, request: pb.SecWaitRequest) -> UnmaskRequest | None:
        """Whose shares the worker must send, or None while the round is open."""
        return self._wait(request, SecureSession.survivors)

    def unmask(self, request: pb.SecUnmaskRequest) -> None:
        """A survivor's shares for the close."""
        _, session = self._session(request.job_id, request.round, request.worker_id)
        session.unmask(request.worker_id, _one_each(request.worker_id, [(v.peer, bytes(v.share))
                                                                         for v in request.shares]))

    # ----- the masked upload -----

    @staticmethod
    def check_header(header: pb.UpdateHeader, secure: SecureSession | GroupedSession | None) -> None:
        """A secure round's upload is one flat ring vector named `masked`, of the round's dtype and length,
        for the samples its worker advertised (checked against its registered count then); only it is."""
        if secure is None:
            raise UploadRejected(Rejection.BAD_HEADER, f"round {header.round} of job {header.job_id!r} is not a "
                                                       f"secure round: it takes no masked upload")
        session = secure.of(header.worker_id)
        if session.failed is not None:  # a lost round says so (not that the upload has the wrong shape)
            raise refused(session.failed)
        if not header.masked:
            raise UploadRejected(Rejection.BAD_HEADER, f"{session.where} takes only masked uploads (the worker "
                                                       f"must run the secure protocol)")
        want = [("masked", np.dtype(session.params.dtype).name, [session.length])]
        got = [(t.name, t.dtype, list(t.shape)) for t in header.tensors]
        if got != want:
            raise UploadRejected(Rejection.WRONG_SHAPE, f"worker {header.worker_id!r}: a masked upload of "
                                                        f"{session.where} is {want}, got {got}")
        session.check_masked(header.worker_id, int(header.num_samples))

    def receive_masked(self, header: pb.UpdateHeader, stream: Iterator[pb.UpdateChunk], size: int) -> Receipt:
        """Read the masked vector, add it to the round's running sum, count the worker: nothing is spooled."""
        table = self.table
        tensors, digest = codec.receive_payload(stream, header, size, buffer=None)
        job = table.job(header.job_id)
        meta = UpdateMeta(worker_id=header.worker_id, num_samples=int(header.num_samples),
                          ish=header.ish if header.has_ish else None, loss=header.validation_loss or header.train_loss)
        with table.accept_lock, table.lock:
            rnd = receiving(job, header)
            first = rnd.receipt(header.job_id, header.worker_id)
            if first is not None:  # a concurrent retry won the race: counted once
                return first
            assert rnd.secure is not None
            session = rnd.secure.of(header.worker_id)
            session.add_masked(header.worker_id, tensors.pop("masked"))
            raw = session.weights[header.worker_id][1]
            rnd.accepted[header.worker_id] = Accepted(header.worker_id, meta.num_samples, raw, digest, size, meta,
                                                      epsilon=header.epsilon, train_loss=header.train_loss)
            table.touch(job)
        return Receipt(header.job_id, header.round, header.worker_id, False, size, digest)

    # ----- the close -----

    def combine_secure(self, rnd: Round, current: dict[str, np.ndarray], spec: ModelSpec) -> Combined:
        """Name the survivors, wait for their unmask shares, and make the next global model from the sum:
        x_global + Σ_U scale_i·Δ_i / Σ_U scale_i, the weighted mean delta of the survivors."""
        session = rnd.secure
        assert session is not None
        if isinstance(session, GroupedSession):  # a robust rule over the groups' means (secure_groups)
            c = combine_grouped(session, rule=rnd.algorithms.robust, rule_name=rnd.algorithms.settings.robust.name,
                                selection_method=rnd.algorithms.settings.selection.name, accepted=len(rnd.accepted),
                                current=current, spec=spec, unmask_s=self.unmask_s, round_number=rnd.number)
            return Combined(c.chosen, c.weights, spec, c.state, c.stats, c.selection, c.verdicts, excluded=c.excluded)
        if session.ddp is not None:  # one DP-SGD step from the noisy gradient sum, not a weighted mean
            return secure_ddp.combine_ddp(rnd, current, spec, unmask_s=self.unmask_s)
        session.decide()
        result = session.finish(wait_s=self.unmask_s)
        for worker, why in sorted(session.excluded.items()):
            log.warning("%s excluded worker %s: %s", session.where, worker, why)
        share = session.scale_sum(result.survivors)
        if share <= 0:
            raise refused(f"{session.where}: the survivors' weights sum to 0")
        layout = Layout(parameter_shapes(spec))
        mean = result.total / share
        state = {name: (np.asarray(current[name], dtype=np.float64) + mean[start:stop].reshape(shape)).astype(np.float32)
                 for (name, shape), (start, stop) in zip(layout.shapes.items(), layout.offsets.values())}
        raw = np.array([session.weights[w][1] for w in result.survivors])
        stats = {"accepted": float(len(rnd.accepted)), "aggregated": float(len(result.survivors)),
                 "secure_dropped": float(len(result.dropped)), "secure_error_max": result.error_max / share,
                 "secure_threshold": float(session.params.threshold)}
        selection = SelectionRecord(method=rnd.algorithms.settings.selection.name, accepted=len(rnd.accepted),
                                    chosen=len(result.survivors))
        return Combined(list(result.survivors), raw / raw.sum(), spec, state, stats, selection, [],
                        excluded=sorted(session.excluded))


def _one_each(worker_id: str, by_peer: list[tuple[str, V]]) -> dict[str, V]:
    """A worker's per-peer values (shares, complaints), refused when it names a peer twice."""
    out = dict(by_peer)
    if len(out) != len(by_peer):
        raise UploadRejected(Rejection.BAD_HEADER, f"worker {worker_id!r} names a peer twice")
    return out
