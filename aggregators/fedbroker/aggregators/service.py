"""The aggregation service over gRPC: a thin servicer that converts messages and maps errors.

With a token table, every call is authenticated (fedbroker.rpc.auth): the coordinator runs rounds, a worker
downloads global models and uploads updates under its own worker id only, and sees only itself in a
round's status. With TLS settings the port speaks TLS (optionally mutual TLS).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import TypeVar

import grpc
import numpy as np

from fedbroker.aggregators import metrics
from fedbroker.aggregators.presence import HeartbeatPacing, Pacer, PresenceServicer
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.secure_ddp import sec_params
from fedbroker.errors import Rejection, UploadRejected
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc import codec
from fedbroker.rpc.aio_server import AioServer, Handlers, collect
from fedbroker.rpc.auth import ROLE_COORDINATOR, ROLE_WORKER, Identity, ServerAuth, ServerTLS, TokenLookup
from fedbroker.rpc.callguard import CallGuard, CallLimits
from fedbroker.rpc.live_auth import front_interceptors
from fedbroker.rpc.plumbing import handle

log = logging.getLogger(__name__)
SERVICE_NAME = "fedbroker.v1.Aggregation"

SECURE_CALLS = metrics.SECURE_CALLS  # a secure round's steps (aggregation.secure)
# Who may call what when authentication is on (anything unlisted is refused to everyone).
PERMISSIONS: dict[str, frozenset[str]] = {
    "InstallJob": frozenset({ROLE_COORDINATOR}),
    "GetJobSettings": frozenset({ROLE_WORKER}),
    "PutGlobalModel": frozenset({ROLE_COORDINATOR}),
    "OpenRound": frozenset({ROLE_COORDINATOR}),
    "CloseRound": frozenset({ROLE_COORDINATOR}),
    "AbandonRound": frozenset({ROLE_COORDINATOR}),
    "RoundStatus": frozenset({ROLE_COORDINATOR, ROLE_WORKER}),
    "DownloadGlobalModel": frozenset({ROLE_COORDINATOR, ROLE_WORKER}),
    "UploadUpdate": frozenset({ROLE_WORKER}),
    "UploadWhole": frozenset({ROLE_WORKER}),
    "StartTask": frozenset({ROLE_WORKER}),
    "OpenBuffer": frozenset({ROLE_COORDINATOR}),
    "IssueTasks": frozenset({ROLE_COORDINATOR}),
    "BufferStatus": frozenset({ROLE_COORDINATOR}),
    "CloseBuffer": frozenset({ROLE_COORDINATOR}),
    "Watch": frozenset({ROLE_COORDINATOR}),
    "KeepAlive": frozenset({ROLE_WORKER}),
    **{method: frozenset({ROLE_WORKER}) for method in SECURE_CALLS},
}
_T = TypeVar("_T")
# Answered on the event loop: from memory, under locks no close or disk write holds for long. Every other
# call runs in the bounded executor (closes, the spool's fsyncs, long polls, streams read message by message).
ON_THE_LOOP = frozenset({"RoundStatus", "StartTask", "InstallJob", "GetJobSettings", "KeepAlive", "IssueTasks",
                         "BufferStatus"})
UPLOADS = frozenset({"UploadUpdate", "UploadWhole"})
WATCH_KEEPALIVE_S = 5.0  # an empty JobChanges this often: the stream is never idle


def _count_refusal(method: str, reason: str) -> None:
    """The authentication interceptor's refusals (unauthenticated, permission_denied) of uploads."""
    if method in UPLOADS:
        metrics.record_rejection(Rejection(reason))


def _counted(call: str, fn: Callable[[], _T]) -> Callable[[], _T]:
    """A secure-protocol call whose refusals are counted by call and reason."""
    def run() -> _T:
        try:
            return fn()
        except UploadRejected as exc:
            metrics.record_secure_refusal(call, exc.reason)
            raise

    return run


class AggregationServicer(pb_grpc.AggregationServicer):
    """The synchronous rounds' calls: the coordinator runs rounds, workers download and upload."""

    def __init__(self, book: RoundBook, auth: ServerAuth | None = None) -> None:
        self.book = book
        self.auth = auth
        self._algorithms: dict[str, dict[str, str]] = {}  # job → algorithm names of its last opened round (labels)
        self._digests = DigestCache()

    def _caller(self, context: grpc.ServicerContext) -> Identity | None:
        return self.auth.identity(context) if self.auth is not None else None

    def PutGlobalModel(self, request_iterator: Iterator[pb.ModelChunk], context: grpc.ServicerContext) -> pb.UploadReceipt:
        """Install a job's global model (streamed)."""
        def run() -> pb.UploadReceipt:
            header, tensors, digest = codec.receive(request_iterator, max_bytes=self.book.max_update_bytes)
            self.book.put_global(header.job_id, header.version, header.model_spec_json, tensors)
            size = sum(a.nbytes for a in tensors.values())
            metrics.RECEIVED_BYTES.labels("PutGlobalModel").inc(size)
            return pb.UploadReceipt(job_id=header.job_id, sha256=digest, bytes_received=size)

        return handle(context, run)

    def InstallJob(self, request: pb.InstallJobRequest, context: grpc.ServicerContext) -> pb.InstallJobReply:
        """Install a job's settings once (idempotent; other settings for the same job are refused)."""
        return handle(context, lambda: pb.InstallJobReply(
            digest=self.book.installed.install(request.settings).installed.digest))

    def GetJobSettings(self, request: pb.GetJobSettingsRequest,
                       context: grpc.ServicerContext) -> pb.GetJobSettingsReply:
        """A job's settings for one of its participants, under its own worker id only."""
        def run() -> pb.GetJobSettingsReply:
            self._own(context, request.worker_id)
            settings = self.book.settings_for(request.job_id, request.worker_id)
            return pb.GetJobSettingsReply(settings=settings, digest=self.book.installed.get(request.job_id).installed.digest)

        return handle(context, run)

    def OpenRound(self, request: pb.OpenRoundRequest, context: grpc.ServicerContext) -> pb.OpenRoundReply:
        """Open a round (idempotent) with the job's installed settings; its algorithm names label the close's
        metrics. An older coordinator's request carries the aggregation section instead (read for one release)."""
        def run() -> pb.OpenRoundReply:
            legacy = json.loads(request.aggregation_json) if request.aggregation_json else None  # deprecated field
            version = self.book.open_round(request.job_id, request.round, request.participants,
                                           request.deadline_unix, legacy, seed=request.seed,
                                           histograms={w: list(h.counts) for w, h in request.histograms.items()},
                                           num_samples=dict(request.num_samples))
            labels = metrics.algorithm_labels(self.book.installed.get(request.job_id).settings)
            self._algorithms[request.job_id] = labels
            metrics.robust_round_opened(labels["robust"], request.participants)
            return pb.OpenRoundReply(model_version=version)

        return handle(context, run)

    def UploadUpdate(self, request_iterator: Iterator[pb.UpdateChunk], context: grpc.ServicerContext) -> pb.UploadReceipt:
        """A worker's update, streamed; only under its own worker id when authentication is on."""
        caller = self._caller(context)
        return handle(context, lambda: self._receive(request_iterator, caller, "UploadUpdate"))

    def UploadWhole(self, request: pb.WholeUpdate, context: grpc.ServicerContext) -> pb.UploadReceipt:
        """A small update in one message (see UploadUpdate)."""
        caller = self._caller(context)
        return handle(context, lambda: self._receive(
            codec.as_stream(pb.UpdateChunk, request.header, request.data, request.sha256), caller, "UploadWhole"))

    def _receive(self, messages: Iterable[pb.UpdateChunk], caller: Identity | None, method: str) -> pb.UploadReceipt:
        try:
            r = self.book.receive_update(_own_uploads_only(messages, caller))
        except UploadRejected as exc:
            metrics.record_rejection(exc.reason)
            raise
        if r.duplicate:
            metrics.UPLOADS_DUPLICATE.inc()
        else:
            metrics.UPLOADS_ACCEPTED.inc()
            metrics.RECEIVED_BYTES.labels(method).inc(r.bytes_received)
        return pb.UploadReceipt(job_id=r.job_id, round=r.round, worker_id=r.worker_id, duplicate=r.duplicate,
                                bytes_received=r.bytes_received, sha256=r.sha256)

    def StartTask(self, request: pb.StartTaskRequest, context: grpc.ServicerContext) -> pb.StartTaskReply:
        """Whether the round still wants this worker's update, and the model to train, inline when it fits
        `inline_bytes` (and `codec.INLINE_BYTES`); a larger one comes with its header only, to be streamed."""
        caller = self._caller(context)

        def run() -> pb.StartTaskReply:
            if caller is not None and caller.role == ROLE_WORKER and request.worker_id != caller.name:
                raise UploadRejected(Rejection.PERMISSION_DENIED, f"worker {caller.name!r} may start only its own "
                                                                  f"tasks, not one of worker {request.worker_id!r}")
            accepted, is_open = self.book.worker_status(request.job_id, request.round, request.worker_id)
            reply = pb.StartTaskReply(accepted=accepted, open=is_open)
            if accepted or not is_open or request.inline_bytes <= 0:
                return reply
            version, spec_json, tensors = self.book.global_model(request.job_id, request.version)
            reply.header.CopyFrom(pb.ModelHeader(job_id=request.job_id, version=version, model_spec_json=spec_json,
                                                 tensors=codec.tensor_specs(tensors)))
            size = sum(a.nbytes for a in tensors.values())
            if size <= min(request.inline_bytes, codec.INLINE_BYTES):
                # hashed once for every worker of the round (as for streamed downloads), not once per worker
                reply.sha256 = self._digests.digest((request.job_id, version), tensors).result()
                reply.data = codec.joined(tensors)
                metrics.SENT_BYTES.labels("StartTask").inc(size)
            return reply

        return handle(context, run)

    # ----- a secure round's steps (aggregation.secure): each under the caller's own worker id -----

    def _own(self, context: grpc.ServicerContext, worker_id: str) -> None:
        caller = self._caller(context)
        if caller is not None and caller.role == ROLE_WORKER and worker_id != caller.name:
            raise UploadRejected(Rejection.PERMISSION_DENIED, f"worker {caller.name!r} may take part in a secure "
                                                              f"round only as itself, not as {worker_id!r}")

    def SecAdvertise(self, request: pb.SecAdvertiseRequest, context: grpc.ServicerContext) -> pb.SecAdvertiseReply:
        """The worker's public keys and declared weight; the round's settings back."""
        def run() -> pb.SecAdvertiseReply:
            self._own(context, request.worker_id)
            session = self.book.secure.advertise(request)
            p = session.params
            return pb.SecAdvertiseReply(round_seed=session.seed, params=sec_params(session, pb.SecParams(
                threshold=p.threshold, neighbours=p.neighbours, ring_bits=p.bits, clip=p.clip,
                ring_dtype=np.dtype(p.dtype).name, length=session.length, n_max=p.n_max)))

        return handle(context, _counted("SecAdvertise", run))

    def SecRoster(self, request: pb.SecWaitRequest, context: grpc.ServicerContext) -> pb.SecRosterReply:
        """Long poll: the worker's peers and weight share once the roster is fixed."""
        def run() -> pb.SecRosterReply:
            self._own(context, request.worker_id)
            roster = self.book.secure.roster(request)
            if roster is None:
                return pb.SecRosterReply(ready=False)
            return pb.SecRosterReply(ready=True, scale=roster.scale, roster_size=roster.size, peers=[
                pb.SecPeer(worker_id=w, cipher_key=k.c_pk, mask_key=k.s_pk) for w, k in sorted(roster.peers.items())])

        return handle(context, _counted("SecRoster", run))

    def SecShare(self, request: pb.SecShareRequest, context: grpc.ServicerContext) -> pb.SecShareReply:
        """The worker's sealed shares, routed to its peers' inboxes."""
        def run() -> pb.SecShareReply:
            self._own(context, request.worker_id)
            self.book.secure.share(request)
            return pb.SecShareReply()

        return handle(context, _counted("SecShare", run))

    def SecInbox(self, request: pb.SecWaitRequest, context: grpc.ServicerContext) -> pb.SecInboxReply:
        """Long poll: the sealed shares peers sent the worker, once the inboxes are fixed."""
        def run() -> pb.SecInboxReply:
            self._own(context, request.worker_id)
            box = self.book.secure.inbox(request)
            if box is None:
                return pb.SecInboxReply(ready=False)
            return pb.SecInboxReply(ready=True, ciphertexts=[pb.SecCiphertext(peer=w, data=d)
                                                             for w, d in sorted(box.items())])

        return handle(context, _counted("SecInbox", run))

    def SecVerify(self, request: pb.SecVerifyRequest, context: grpc.ServicerContext) -> pb.SecVerifyReply:
        """Long poll, before the worker trains: its failed senders in, every excluded sender out once fixed."""
        def run() -> pb.SecVerifyReply:
            self._own(context, request.worker_id)
            excluded = self.book.secure.verify(request)
            if excluded is None:
                return pb.SecVerifyReply(ready=False)
            return pb.SecVerifyReply(ready=True, excluded=sorted(excluded))

        return handle(context, _counted("SecVerify", run))

    def SecSurvivors(self, request: pb.SecWaitRequest, context: grpc.ServicerContext) -> pb.SecSurvivorsReply:
        """Long poll: at the close, the survivors and the dropped workers this worker holds shares of."""
        def run() -> pb.SecSurvivorsReply:
            self._own(context, request.worker_id)
            named = self.book.secure.survivors(request)
            if named is None:
                return pb.SecSurvivorsReply(ready=False)
            return pb.SecSurvivorsReply(ready=True, survivors=sorted(named.survivors), dropped=sorted(named.dropped))

        return handle(context, _counted("SecSurvivors", run))

    def SecUnmask(self, request: pb.SecUnmaskRequest, context: grpc.ServicerContext) -> pb.SecUnmaskReply:
        """A survivor's shares, which remove the masks from the round's sum."""
        def run() -> pb.SecUnmaskReply:
            self._own(context, request.worker_id)
            self.book.secure.unmask(request)
            return pb.SecUnmaskReply()

        return handle(context, _counted("SecUnmask", run))

    def DownloadGlobalModel(self, request: pb.GlobalModelRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialized ModelChunk messages (the method is registered without a serializer, see `_add_servicer`).

        Every worker of a round downloads the same version: its SHA-256 is computed once (`DigestCache`),
        overlapped with sending it.
        """
        version, spec_json, tensors = handle(context, lambda: self.book.global_model(request.job_id, request.version))
        header = pb.ModelHeader(job_id=request.job_id, version=version, model_spec_json=spec_json,
                                tensors=codec.tensor_specs(tensors))
        digest = self._digests.digest((request.job_id, version), tensors)
        yield from codec.encoded_stream(pb.ModelChunk, header, tensors, sha256=digest.result)
        metrics.SENT_BYTES.labels("DownloadGlobalModel").inc(sum(a.nbytes for a in tensors.values()))

    def RoundStatus(self, request: pb.RoundStatusRequest, context: grpc.ServicerContext) -> pb.RoundStatusReply:
        """Who got into a round and whether it is open; a worker sees only itself."""
        accepted, is_open = handle(context, lambda: self.book.status(request.job_id, request.round))
        caller = self._caller(context)
        if caller is not None and caller.role == ROLE_WORKER:  # a worker learns about itself, not its peers
            accepted = [w for w in accepted if w == caller.name]
        return pb.RoundStatusReply(accepted=accepted, open=is_open)

    def CloseRound(self, request: pb.CloseRoundRequest, context: grpc.ServicerContext) -> pb.CloseRoundReply:
        """Aggregate a round into the next global version (safe to repeat)."""
        result = handle(context, lambda: self.book.close(request.job_id, request.round))
        algorithms = self._algorithms.get(request.job_id, {})
        metrics.record_close(algorithms, result.seconds, len(result.aggregated), result.stats)
        metrics.record_robust(result.verdicts)
        return pb.CloseRoundReply(model_version=result.model_version, aggregated=result.aggregated,
                                  model_spec_json=result.model_spec_json, stats=result.stats, seconds=result.seconds,
                                  verdicts=[v.to_proto() for v in result.verdicts], excluded=result.excluded,
                                  selection=result.selection.to_proto() if result.selection else None,
                                  updates=[pb.UpdateSummary(worker_id=u.worker_id, num_samples=u.num_samples,
                                                            epsilon=u.epsilon, train_loss=u.train_loss, weight=u.weight)
                                           for u in result.updates])

    def AbandonRound(self, request: pb.AbandonRoundRequest, context: grpc.ServicerContext) -> pb.AbandonRoundReply:
        """Drop a cancelled job's round unaggregated; the uploads it discarded."""
        dropped = handle(context, lambda: self.book.abandon(request.job_id, request.round))
        return pb.AbandonRoundReply(discarded=[pb.UpdateSummary(worker_id=u.worker_id, num_samples=u.num_samples,
                                                                epsilon=u.epsilon, train_loss=u.train_loss)
                                               for u in dropped])


class AsyncAggregationServicer(pb_grpc.AsyncAggregationServicer):
    """Asynchronous mode (FedBuff): the coordinator opens a job's buffer, issues tasks, reads the versions."""

    def __init__(self, book: RoundBook) -> None:
        self.book = book

    def OpenBuffer(self, request: pb.OpenBufferRequest, context: grpc.ServicerContext) -> pb.OpenBufferReply:
        """Put a job in asynchronous mode (idempotent)."""
        def run() -> pb.OpenBufferReply:
            config = {"buffer_size": request.buffer_size,
                      "max_staleness": request.max_staleness, "staleness": request.staleness,
                      "staleness_params": json.loads(request.staleness_params_json or "{}"),
                      "server_lr": request.server_lr, "seed": request.seed}
            if request.aggregation_json:  # an older coordinator's section (deprecated): no installed settings
                config["aggregation"] = json.loads(request.aggregation_json)
            return pb.OpenBufferReply(model_version=self.book.open_buffer(request.job_id, config,
                                                                          num_samples=dict(request.num_samples)))

        return handle(context, run)

    def IssueTasks(self, request: pb.IssueTasksRequest, context: grpc.ServicerContext) -> pb.IssueTasksReply:
        """New tasks on the newest version for the named workers, each bounded by its registered sample count."""
        issued = handle(context, lambda: self.book.issue_tasks(request.job_id, list(request.workers),
                                                               num_samples=dict(request.num_samples)))
        return pb.IssueTasksReply(tasks=[pb.IssuedTask(worker_id=w, task=i.task, base_version=i.base)
                                         for w, i in issued])

    def CloseBuffer(self, request: pb.CloseBufferRequest, context: grpc.ServicerContext) -> pb.CloseBufferReply:
        """End a job's buffer (idempotent); the updates it still holds, which no version holds."""
        version, left = handle(context, lambda: self.book.close_buffer(request.job_id))
        return pb.CloseBufferReply(model_version=version, discarded=[
            pb.UpdateSummary(worker_id=u.worker_id, num_samples=u.num_samples, epsilon=u.epsilon,
                             train_loss=u.train_loss, task=u.task) for u in left])

    def BufferStatus(self, request: pb.BufferStatusRequest, context: grpc.ServicerContext) -> pb.BufferStatusReply:
        """The buffer's fill, the outstanding tasks and the versions since `since_version`."""
        version, state = handle(context, lambda: self.book.buffer_status(request.job_id, request.since_version))
        return pb.BufferStatusReply(
            model_version=version, buffered=len(state.folded), buffer_size=state.buffer.buffer_size,
            outstanding=[pb.IssuedTask(worker_id=w, task=i.task, base_version=i.base) for w, i in state.issued.items()],
            versions=[pb.VersionRow(version=v.version, created_unix=v.created, staleness=[u.tau for u in v.updates],
                                    updates=[pb.UpdateSummary(worker_id=u.worker_id, num_samples=u.num_samples,
                                                              epsilon=u.epsilon, train_loss=u.train_loss,
                                                              weight=v.coefficient(u), task=u.task)
                                             for u in v.updates])
                      for v in state.summaries],
            refused_stale=state.refused_stale)


class EventsServicer(pb_grpc.AggregationEventsServicer):
    """Tells the coordinator the moment a job changes (an upload accepted, a round or version done)."""

    def __init__(self, book: RoundBook, keepalive_s: float = WATCH_KEEPALIVE_S) -> None:
        self.book = book
        self.keepalive_s = keepalive_s

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.JobChanges]:
        """Every change of every job, as it happens, with a keep-alive while nothing changes."""
        after, wait = 0, 0.0  # the first message at once, with every job: a watcher that reconnects learns
        while context.is_active():  # at once what a restarted service still holds (maybe nothing)
            after, changed = self.book.watch(after, wait)
            wait = self.keepalive_s
            yield pb.JobChanges(jobs=[pb.JobSnapshot(job_id=j.job_id, round=j.round, accepted=j.accepted, open=j.open,
                                                    model_version=j.version, buffered=j.buffered) for j in changed])


class DigestCache:
    """The SHA-256 of each global model version, hashed once for all of its downloads.

    The first download of a version starts the hash in a helper thread and streams meanwhile; downloads that
    start before it ends (every worker of a round fetches the new version at once) wait for the same hash at
    their trailer instead of hashing again. A (job, version) may be installed again with other weights
    (`put_global` after a coordinator restart), so an entry holds weak references to the arrays it hashed
    and counts only while the book serves those very arrays: a re-installed, restored or freed model is
    hashed afresh. The book never writes into a global model's arrays. Weak references keep no model alive;
    the oldest entries go beyond `max_entries`.
    """

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], tuple[tuple[weakref.ref[np.ndarray], ...], Future[str]]] = \
            OrderedDict()
        self._lock = threading.Lock()

    def digest(self, key: tuple[str, int], tensors: Mapping[str, np.ndarray]) -> Future[str]:
        """The digest of `tensors`, done or under way."""
        arrays = list(tensors.values())
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and _same_arrays(entry[0], arrays):
                self._entries.move_to_end(key)
                return entry[1]
            future: Future[str] = Future()
            self._entries[key] = (tuple(weakref.ref(arr) for arr in arrays), future)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        threading.Thread(target=self._hash, args=(key, dict(tensors), future), name="sha256-global",
                         daemon=True).start()
        return future

    def _hash(self, key: tuple[str, int], tensors: dict[str, np.ndarray], future: Future[str]) -> None:
        try:
            future.set_result(codec.tensors_sha256(tensors))
        except BaseException as exc:  # not kept: the next download of this version tries again
            with self._lock:
                if key in self._entries and self._entries[key][1] is future:
                    del self._entries[key]
            future.set_exception(exc)


def _same_arrays(refs: tuple[weakref.ref[np.ndarray], ...], arrays: list[np.ndarray]) -> bool:
    return len(refs) == len(arrays) and all(ref() is arr for ref, arr in zip(refs, arrays))


def _own_uploads_only(messages: Iterable[pb.UpdateChunk], caller: Identity | None) -> Iterator[pb.UpdateChunk]:
    """Refuse, before reading any tensor data, an upload whose header names another worker than the caller's."""
    iterator = iter(messages)
    first = next(iterator, None)
    if first is None:
        return iter(())
    if caller is not None and first.WhichOneof("part") == "header" and first.header.worker_id != caller.name:
        raise UploadRejected(Rejection.PERMISSION_DENIED, f"worker {caller.name!r} may upload only its own update, "
                                                         f"not one for worker {first.header.worker_id!r}")
    return itertools.chain((first,), iterator)


def _handlers(servicer: AggregationServicer) -> Handlers:
    """The generated registration, except that DownloadGlobalModel has no response serializer: it yields
    messages already serialized by `codec.encoded_stream`, one copy of the model where a protobuf message
    per chunk costs three (into a bytes, into the message, out by SerializeToString)."""
    table = collect(pb_grpc.add_AggregationServicer_to_server, servicer)
    missing = {f"/{SERVICE_NAME}/{m}" for m in pb.DESCRIPTOR.services_by_name["Aggregation"].methods_by_name} - set(table)
    if missing:  # a generator that registers no method handlers: extend `collect`
        raise RuntimeError(f"the generated registration did not list {sorted(missing)}")
    table[f"/{SERVICE_NAME}/DownloadGlobalModel"] = grpc.unary_stream_rpc_method_handler(
        servicer.DownloadGlobalModel, request_deserializer=pb.GlobalModelRequest.FromString)
    return table


def serve(book: RoundBook, *, address: str = "127.0.0.1:0", limits: CallLimits | None = None,
          tokens: TokenLookup | None = None, tls: ServerTLS | None = None,
          heartbeat: HeartbeatPacing | None = None) -> tuple[AioServer, int]:
    """Start the service (with standard gRPC health checking) on an asyncio gRPC server in a thread of its
    own (`fedbroker.rpc.aio_server`) and return it with its bound port.

    `limits`: how its calls are shared out (`fedbroker.rpc.callguard`: health checks keep slots of their
    own, workers' transfers are capped in all and per worker, a stream idle on its client is ended; `threads`
    also bounds the executor of the blocking calls); `tokens`: authenticate every call (None =
    authentication off); `tls`: serve TLS instead of plaintext; `heartbeat`: how workers' heartbeats are
    paced (`presence.HeartbeatPacing`).
    """
    limits = limits or CallLimits()
    interceptors, auth = front_interceptors(tls, tokens, service=SERVICE_NAME, permissions=PERMISSIONS,
                                            on_reject=_count_refusal)
    interceptors.append(CallGuard(limits, service=SERVICE_NAME, identify=auth.identity if auth else None,
                                  trusted_roles=frozenset({ROLE_COORDINATOR}), on_refuse=_count_refusal,
                                  uncapped=frozenset({"Watch"})))
    table = {**_handlers(AggregationServicer(book, auth)),
             **collect(pb_grpc.add_AsyncAggregationServicer_to_server, AsyncAggregationServicer(book)),
             **collect(pb_grpc.add_AggregationEventsServicer_to_server, EventsServicer(book)),
             **collect(pb_grpc.add_WorkerPresenceServicer_to_server,
                       PresenceServicer(Pacer(heartbeat), auth.identity if auth else None))}
    # a small upload is in memory at once; with a spool it is fsynced before the receipt: then off the loop
    inline = ON_THE_LOOP | (frozenset() if book.table.spool is not None else frozenset({"UploadWhole"}))
    server = AioServer(table, address=address, tls=tls, service=SERVICE_NAME, interceptors=interceptors,
                       inline=inline, threads=limits.threads)
    log.info("aggregation service listening on port %d (%s, authentication %s)", server.port,
             "TLS" + (" with client certificates" if tls and tls.client_ca else "") if tls else "plaintext",
             "on" if auth else "off")
    return server, server.port
