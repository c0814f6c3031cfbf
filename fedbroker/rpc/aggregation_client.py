"""A client of the aggregation service, used by workers and the coordinator (so it lives in the kernel, and
neither service imports the other): deadlines on every call, retries only where repeating is safe, and the
caller's bearer token (and TLS) from its ClientSecurity.

A call retries an unavailable service a few times (`rpc.call_with_retry`). A caller whose calls are worth
making until a deadline (a worker: its round's) takes `until(deadline_unix)`, and every call retries until
then. A caller that rides out longer outages itself (the coordinator, for `aggregator_outage_s`) takes
`without_retries()`, so retries never nest.

A worker's task takes two calls: `start_task` (is the round still open, is our update already in, and
the global model, inline when it is small) and `upload` (one unary message when the update is small).
Unary calls cost a fraction of a stream's thread hand-offs, and the control plane of a round of small
models is these calls. A model above `codec.INLINE_BYTES` streams: those calls skip protobuf objects for
the data chunks (`codec.encoded_stream` and `codec.decoded_stream`: the same bytes on the wire, two to
three fewer copies of the model per transfer); every other call goes through the generated stub.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import grpc
import numpy as np

from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc import codec
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import RPC_ATTEMPTS, call_with_retry
from fedbroker.rpc.replicas import Replicas, split_targets
from fedbroker.secagg.secure_round import LONG_POLL_S, REPOLL_S

T = TypeVar("T")


def _path(method: str) -> str:
    """The gRPC path of an Aggregation method, from the proto descriptor (as the generated stub builds it)."""
    service = pb.DESCRIPTOR.services_by_name["Aggregation"]
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


Model = tuple[int, str, dict[str, np.ndarray]]  # (version, spec JSON, tensors)


@dataclass(frozen=True)
class TaskStart:
    """What `start_task` learned: whether our update is already in, whether the round still takes one, and
    the model to train (when asked for, and only for a round that still wants our update)."""

    accepted: bool
    open: bool
    model: Model | None


class AggregatorClient:
    """The aggregation service with every call it offers (see the module docstring). `target` names one
    service, or its replicas separated by commas (`aggregator.targets`): calls go to one of them (`Replicas`)."""

    def __init__(self, target: str, *, timeout_s: float = 30.0, transfer_timeout_s: float = 600.0,
                 max_model_bytes: int = 1 << 30, security: ClientSecurity | None = None,
                 attempts: int = RPC_ATTEMPTS) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.max_model_bytes = max_model_bytes
        self.attempts = attempts  # tries per call for the errors it is safe to repeat on
        self.deadline_unix: float | None = None  # set: retry until then instead (see `until`)
        self._replicas = Replicas(split_targets(target), security)
        self._md = self._replicas.metadata

    def close(self) -> None:
        """Close every channel."""
        self._replicas.close()

    def __enter__(self) -> AggregatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the current replica's stubs, read at each call (a failover changes them for every copy of this client)
    @property
    def _stub(self) -> pb_grpc.AggregationStub:
        return self._replicas.current().stub

    @property
    def _async_stub(self) -> pb_grpc.AsyncAggregationStub:
        return self._replicas.current().async_stub

    @property
    def _events_stub(self) -> pb_grpc.AggregationEventsStub:
        return self._replicas.current().events_stub

    @property
    def _presence_stub(self) -> pb_grpc.WorkerPresenceStub:
        return self._replicas.current().presence_stub

    @property
    def _put_global(self) -> grpc.StreamUnaryMultiCallable[bytes, pb.UploadReceipt]:
        return self._replicas.current().put_global

    @property
    def _upload(self) -> grpc.StreamUnaryMultiCallable[bytes, pb.UploadReceipt]:
        return self._replicas.current().upload

    @property
    def _download(self) -> grpc.UnaryStreamMultiCallable[pb.GlobalModelRequest, bytes]:
        return self._replicas.current().download

    def without_retries(self) -> AggregatorClient:
        """This client, on the same channel, calling once: for a caller that owns the retrying."""
        once = copy.copy(self)
        once.attempts, once.deadline_unix = 1, None
        return once

    def until(self, deadline_unix: float | None) -> AggregatorClient:
        """This client, on the same channel, retrying every call until `deadline_unix` (a Unix time) instead
        of `attempts` times: for a caller whose calls are worth making until then and no longer (a worker's
        status, download and upload until its round's deadline). None or 0: no deadline, `attempts` tries."""
        bounded = copy.copy(self)
        bounded.deadline_unix = deadline_unix or None
        return bounded

    def _retry(self, fn: Callable[[], T], *, what: str, idempotent: bool) -> T:
        return call_with_retry(self._replicas.routed(fn), what=what, idempotent=idempotent, attempts=self.attempts,
                               deadline_unix=self.deadline_unix)

    def put_global(self, job_id: str, version: int, spec_json: str, tensors: Mapping[str, np.ndarray]) -> None:
        """Install a job's global model, streamed (idempotent)."""
        header = pb.ModelHeader(job_id=job_id, version=version, model_spec_json=spec_json,
                                tensors=codec.tensor_specs(tensors))
        self._retry(
            lambda: self._put_global(codec.encoded_stream(pb.ModelChunk, header, tensors),
                                     timeout=self.transfer_timeout_s, metadata=self._md),
            what=f"put global model of job {job_id}", idempotent=True,
        )

    def download(self, job_id: str, version: int = 0) -> tuple[int, str, dict[str, np.ndarray]]:
        """A global model version (0: the newest): (version, spec JSON, tensors), digest-checked."""
        def run() -> tuple[int, str, dict[str, np.ndarray]]:
            stream = self._download(pb.GlobalModelRequest(job_id=job_id, version=version),
                                    timeout=self.transfer_timeout_s, metadata=self._md)
            header, tensors, _ = codec.receive(codec.decoded_stream(stream, pb.ModelChunk),
                                               max_bytes=self.max_model_bytes)
            return header.version, header.model_spec_json, tensors

        return self._retry(run, what=f"download global model of job {job_id}", idempotent=True)

    def job_settings(self, job_id: str, worker_id: str, digest: str) -> pb.JobSettings:
        """A job's installed settings, for a participant that lacks them (it restarted since its first task)."""
        request = pb.GetJobSettingsRequest(job_id=job_id, worker_id=worker_id, digest=digest)
        reply: pb.GetJobSettingsReply = self._retry(
            lambda: self._stub.GetJobSettings(request, timeout=self.timeout_s, metadata=self._md),
            what=f"settings of job {job_id}", idempotent=True)
        return reply.settings

    def keep_alive(self, worker_id: str, state: str = "idle", *, timeout_s: float | None = None) -> float:
        """A worker's heartbeat; the seconds until the service wants the next one (paced and jittered by the
        service: call again then, not sooner, or the beat is refused as `heartbeat_early`). One try, following a
        replica's `not_owner` redirect; the caller owns the retrying (worker/presence.py)."""
        request = pb.KeepAliveRequest(worker_id=worker_id, state=state)
        reply: pb.KeepAliveReply = self._replicas.routed(lambda: self._presence_stub.KeepAlive(
            request, timeout=timeout_s or self.timeout_s, metadata=self._md))()
        return reply.next_in_ms / 1000

    def start_task(self, job_id: str, round: int, worker_id: str, version: int, *, model: bool = True) -> TaskStart:
        """A task's first call: the round's (async: the task's) status for this worker and, with `model`, the
        global `version` to train from, inline when it fits one message, else streamed (a second call)."""
        request = pb.StartTaskRequest(job_id=job_id, round=round, worker_id=worker_id, version=version,
                                      inline_bytes=codec.INLINE_BYTES if model else 0)
        reply: pb.StartTaskReply = self._retry(
            lambda: self._stub.StartTask(request, timeout=self.timeout_s, metadata=self._md),
            what=f"start of round {round} of job {job_id}", idempotent=True,
        )
        if reply.accepted or not reply.open or not model:
            return TaskStart(reply.accepted, reply.open, None)
        if not reply.sha256:  # larger than one message: streamed
            return TaskStart(False, True, self.download(job_id, version))
        header, tensors, _ = codec.receive(codec.as_stream(pb.ModelChunk, reply.header, reply.data, reply.sha256),
                                           max_bytes=self.max_model_bytes)
        return TaskStart(False, True, (header.version, header.model_spec_json, tensors))

    def upload(self, *, job_id: str, round: int, worker_id: str, num_samples: int, tensors: Mapping[str, np.ndarray],
               ish: float | None = None, epsilon: float = 0.0, train_loss: float = 0.0,
               validation_loss: float = 0.0) -> pb.UploadReceipt:
        """Upload is idempotent on (job, round, worker) at the service, so retrying it is safe. An update of
        at most `codec.INLINE_BYTES` goes in one message, a larger one streams."""
        header = pb.UpdateHeader(
            job_id=job_id, round=round, worker_id=worker_id, num_samples=num_samples,
            ish=ish or 0.0, has_ish=ish is not None, epsilon=epsilon, train_loss=train_loss,
            validation_loss=validation_loss, tensors=codec.tensor_specs(tensors),
        )
        return self._send(header, tensors, what=f"upload of {worker_id} for round {round}")

    def upload_masked(self, *, job_id: str, round: int, worker_id: str, num_samples: int, masked: np.ndarray,
                      ish: float | None = None, epsilon: float = 0.0, train_loss: float = 0.0) -> pb.UploadReceipt:
        """A secure round's upload: the masked ring vector as the one tensor `masked`, through the same
        path, checks and idempotence as `upload` (the header says `masked`)."""
        tensors = {"masked": masked}
        header = pb.UpdateHeader(job_id=job_id, round=round, worker_id=worker_id, num_samples=num_samples,
                                 ish=ish or 0.0, has_ish=ish is not None, epsilon=epsilon, train_loss=train_loss,
                                 tensors=codec.tensor_specs(tensors), masked=True)
        return self._send(header, tensors, what=f"masked upload of {worker_id} for round {round}")

    def _send(self, header: pb.UpdateHeader, tensors: Mapping[str, np.ndarray], *, what: str) -> pb.UploadReceipt:
        """One upload, retried (the service is idempotent on job, round and worker): at most
        `codec.INLINE_BYTES` in one message, a larger one streamed."""
        call: Callable[[], pb.UploadReceipt]
        if sum(a.nbytes for a in tensors.values()) <= codec.INLINE_BYTES:
            whole = pb.WholeUpdate(header=header, data=codec.joined(tensors), sha256=codec.tensors_sha256(tensors))
            call = lambda: self._stub.UploadWhole(whole, timeout=self.transfer_timeout_s,  # noqa: E731
                                                  metadata=self._md)
        else:
            call = lambda: self._upload(codec.encoded_stream(pb.UpdateChunk, header, tensors),  # noqa: E731
                                        timeout=self.transfer_timeout_s, metadata=self._md)
        receipt: pb.UploadReceipt = self._retry(call, what=what, idempotent=True)
        return receipt

    # ----- a secure round's key and share messages (a worker's, under its own identity) -----

    def sec_advertise(self, request: pb.SecAdvertiseRequest) -> pb.SecAdvertiseReply:
        """The worker's public keys and weight; the round's settings back (idempotent for the same keys)."""
        reply: pb.SecAdvertiseReply = self._retry(
            lambda: self._stub.SecAdvertise(request, timeout=self.timeout_s, metadata=self._md),
            what=f"secure keys of {request.worker_id} for round {request.round}", idempotent=True)
        return reply

    def sec_share(self, request: pb.SecShareRequest) -> None:
        """The worker's encrypted shares, one per peer (idempotent for the same set)."""
        self._retry(lambda: self._stub.SecShare(request, timeout=self.timeout_s, metadata=self._md),
                    what=f"secure shares of {request.worker_id} for round {request.round}", idempotent=True)

    def sec_unmask(self, request: pb.SecUnmaskRequest) -> None:
        """The worker's shares for the survivors' self-masks and the dropped workers' mask keys."""
        self._retry(lambda: self._stub.SecUnmask(request, timeout=self.timeout_s, metadata=self._md),
                    what=f"unmask shares of {request.worker_id} for round {request.round}", idempotent=True)

    def sec_roster(self, job_id: str, round: int, worker_id: str, *, until: float) -> pb.SecRosterReply | None:
        """The worker's peers and their keys once the roster is fixed; None if `until` passes first."""
        reply: pb.SecRosterReply | None = self._sec_wait("SecRoster", job_id, round, worker_id, until)
        return reply

    def sec_inbox(self, job_id: str, round: int, worker_id: str, *, until: float) -> pb.SecInboxReply | None:
        """The shares peers encrypted for the worker once the inboxes are fixed; None if `until` passes first."""
        reply: pb.SecInboxReply | None = self._sec_wait("SecInbox", job_id, round, worker_id, until)
        return reply

    def sec_verify(self, job_id: str, round: int, worker_id: str, failed: Mapping[str, str], *,
                   until: float) -> pb.SecVerifyReply | None:
        """Report whose shares failed here (before training); the round's excluded senders once fixed, None if
        `until` passes first."""
        request = pb.SecVerifyRequest(job_id=job_id, round=round, worker_id=worker_id, failed=[
            pb.SecComplaint(peer=peer, reason=why) for peer, why in sorted(failed.items())])
        reply: pb.SecVerifyReply | None = self._sec_wait("SecVerify", job_id, round, worker_id, until, request)
        return reply

    def sec_survivors(self, job_id: str, round: int, worker_id: str, *,
                      until: float) -> pb.SecSurvivorsReply | None:
        """Who is in the sum and who dropped, once the round is closing; None if `until` passes first."""
        reply: pb.SecSurvivorsReply | None = self._sec_wait("SecSurvivors", job_id, round, worker_id, until)
        return reply

    def _sec_wait(self, method: str, job_id: str, round: int, worker_id: str, until: float,
                  request: pb.SecVerifyRequest | None = None) -> Any:
        """Long-poll `method` until its reply is ready, or None once `until` (a Unix time) has passed; the
        service holds each call at most LONG_POLL_S (and at most WAITING_CALLS at once: beyond, it answers
        "not yet" at once), and each is retried like any idempotent call."""
        while True:
            left = until - time.time()
            if left <= 0:
                return None
            wait: pb.SecWaitRequest | pb.SecVerifyRequest = request or pb.SecWaitRequest(
                job_id=job_id, round=round, worker_id=worker_id)
            wait.wait_s = min(LONG_POLL_S, left)
            timeout = min(LONG_POLL_S, left) + self.timeout_s
            reply = self._retry(partial(self._call, method, wait, timeout),
                                what=f"{method} of {worker_id} for round {round}", idempotent=True)
            if reply.ready:
                return reply
            time.sleep(min(random.uniform(*REPOLL_S), max(until - time.time(), 0.0)))  # held or not: a pause

    def _call(self, method: str, request: Any, timeout: float) -> Any:
        """`method` of the replica serving the job now (looked up at each try: a failover changes it)."""
        return getattr(self._stub, method)(request, timeout=timeout, metadata=self._md)

    def install_job(self, settings: pb.JobSettings) -> str:
        """Install a job's settings once, before its model and rounds (idempotent); the digest the service holds."""
        reply: pb.InstallJobReply = self._retry(
            lambda: self._stub.InstallJob(pb.InstallJobRequest(settings=settings), timeout=self.timeout_s,
                                          metadata=self._md),
            what=f"install job {settings.job_id}", idempotent=True)
        return reply.digest

    def open_round(self, job_id: str, round: int, participants: Sequence[str], deadline_unix: float, *, seed: int,
                   histograms: Mapping[str, Sequence[int]] | None = None,
                   num_samples: Mapping[str, int] | None = None) -> int:
        """Open a round of an installed job (`install_job`). `num_samples`: each participant's registered sample
        count, the most an upload of it may claim."""
        request = pb.OpenRoundRequest(
            job_id=job_id, round=round, participants=list(participants), deadline_unix=deadline_unix, seed=seed,
            histograms={w: pb.LabelHistogram(counts=list(h)) for w, h in (histograms or {}).items()},
            num_samples=dict(num_samples or {}),
        )
        reply: pb.OpenRoundReply = self._retry(
            lambda: self._stub.OpenRound(request, timeout=self.timeout_s, metadata=self._md),
            what=f"open round {round}", idempotent=True,
        )
        return reply.model_version

    def status(self, job_id: str, round: int) -> tuple[list[str], bool]:
        """Who got into a round, and whether it is open."""
        reply: pb.RoundStatusReply = self._retry(
            lambda: self._stub.RoundStatus(pb.RoundStatusRequest(job_id=job_id, round=round), timeout=self.timeout_s,
                                           metadata=self._md),
            what=f"status of round {round}", idempotent=True,
        )
        return list(reply.accepted), reply.open

    def close_round(self, job_id: str, round: int, *, timeout_s: float = 600.0) -> pb.CloseRoundReply:
        """Aggregate a round into the next global version; its result (a repeat gets the same one)."""
        # Safe to repeat: a retry while the close runs waits for it, one after it gets the same result back
        # (RoundBook.close). DEADLINE_EXCEEDED is still not retried here: a close that outlived `timeout_s`
        # is the caller's to judge (the coordinator retries it within aggregator_outage_s).
        reply: pb.CloseRoundReply = self._retry(
            lambda: self._stub.CloseRound(pb.CloseRoundRequest(job_id=job_id, round=round), timeout=timeout_s,
                                          metadata=self._md),
            what=f"close round {round}", idempotent=False,
        )
        return reply

    def abandon_round(self, job_id: str, round: int) -> list[pb.UpdateSummary]:
        """Drop a cancelled job's open round, unaggregated; the uploads it discarded. Idempotent."""
        reply: pb.AbandonRoundReply = self._retry(
            lambda: self._stub.AbandonRound(pb.AbandonRoundRequest(job_id=job_id, round=round),
                                            timeout=self.timeout_s, metadata=self._md),
            what=f"abandon round {round}", idempotent=True,
        )
        return list(reply.discarded)
    # ----- asynchronous mode (FedBuff) -----

    def open_buffer(self, job_id: str, *, buffer_size: int, max_staleness: int, staleness: str,
                    staleness_params: Mapping[str, object], server_lr: float, seed: int,
                    num_samples: Mapping[str, int] | None = None) -> int:
        """Put an installed job in asynchronous mode (idempotent); returns the newest global version."""
        request = pb.OpenBufferRequest(
            job_id=job_id, buffer_size=buffer_size,
            max_staleness=max_staleness, staleness=staleness, staleness_params_json=json.dumps(dict(staleness_params)),
            server_lr=server_lr, seed=seed, num_samples=dict(num_samples or {}))
        reply: pb.OpenBufferReply = self._retry(
            lambda: self._async_stub.OpenBuffer(request, timeout=self.timeout_s, metadata=self._md),
            what=f"open the buffer of job {job_id}", idempotent=True)
        return reply.model_version

    def issue_tasks(self, job_id: str, workers: Sequence[str], *,
                    num_samples: Mapping[str, int] | None = None) -> list[pb.IssuedTask]:
        """New tasks on the newest version; repeating it supersedes the tasks of the first call (safe: a task
        is published only after its reply). `num_samples`: each worker's registered sample count, the most its
        upload may claim (the service issues no task to a worker whose count it does not know)."""
        request = pb.IssueTasksRequest(job_id=job_id, workers=list(workers), num_samples=dict(num_samples or {}))
        reply: pb.IssueTasksReply = self._retry(
            lambda: self._async_stub.IssueTasks(request, timeout=self.timeout_s, metadata=self._md),
            what=f"issue tasks of job {job_id}", idempotent=True)
        return list(reply.tasks)

    def buffer_status(self, job_id: str, since_version: int = 0) -> pb.BufferStatusReply:
        """The buffer's fill, outstanding tasks and the versions published since `since_version`."""
        reply: pb.BufferStatusReply = self._retry(
            lambda: self._async_stub.BufferStatus(pb.BufferStatusRequest(job_id=job_id, since_version=since_version),
                                                  timeout=self.timeout_s, metadata=self._md),
            what=f"buffer status of job {job_id}", idempotent=True)
        return reply

    def close_buffer(self, job_id: str) -> pb.CloseBufferReply:
        """End a job's buffer (idempotent): the newest version, and the updates left in the buffer (in no version)."""
        reply: pb.CloseBufferReply = self._retry(
            lambda: self._async_stub.CloseBuffer(pb.CloseBufferRequest(job_id=job_id), timeout=self.timeout_s,
                                                 metadata=self._md),
            what=f"close the buffer of job {job_id}", idempotent=True)
        return reply

    def watch(self) -> Iterator[pb.JobChanges]:
        """The service's job events, until the stream breaks (the caller reconnects; no retry here). The
        first message names every job; `cancel()` on the returned call ends it."""
        stream: Iterator[pb.JobChanges] = self._events_stub.Watch(pb.WatchRequest(), metadata=self._md)
        return stream
