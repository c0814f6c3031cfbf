"""Hostile and malformed input, one table: job specs through the coordinator's real gRPC SubmitJob, updates
through the aggregation service's real gRPC UploadUpdate (and the calls a worker's token must not make),
malformed bodies on the coordinator's control queue and a worker's task queue of the real RabbitMQ.

Every case asserts three things: a clear error naming what was wrong (gRPC status and details, or the
dead-letter queue), a rejection metric that moved (read from the Prometheus registry), and the state that
was accepted before it intact (an update accepted before the bad one still aggregates to the same global
model; a job submitted before is still there, unchanged; the consumers still consume)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import numpy as np
import pika
import pytest
from prometheus_client import REGISTRY

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve as serve_aggregator
from fedbroker.bus import Topology, delete_topology, envelope, open_bus
from fedbroker.config import DPPolicy, WorkerConfig
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import serve as serve_coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc import codec
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.worker.agent import WorkerAgent
from tests.installed import install
from tests.security.conftest import token_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SPEC = parse_model({"input_shape": [4], "layers": [
    {"type": "Linear", "in_features": 4, "out_features": 3}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 3, "out_features": 2}]})
AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}
MAX_UPDATE_BYTES = 10_000
PARTICIPANTS = ["w1", "w2", "w3"]
REGISTERED_SAMPLES = 100  # what each participant registered with the coordinator: the most an upload may claim
REJECTED = "fedbroker_aggregator_uploads_rejected_total"
AUTH_FAILED = "fedbroker_grpc_server_auth_failures_total"
JOB_REJECTED = "fedbroker_coordinator_jobs_rejected_total"


def weights(value: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((3, 4), value, np.float32), "0.bias": np.full(3, value, np.float32),
            "2.weight": np.full((2, 3), value, np.float32), "2.bias": np.full(2, value, np.float32)}


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


# ----- the services, started once for the whole table ------------------------------------------------


@dataclass
class Services:
    rabbitmq_url: str
    tmp: Any
    namespace: str = field(default_factory=lambda: f"fedbroker-hostile-{uuid.uuid4().hex[:8]}")
    deadlines: dict[str, float] = field(default_factory=dict)   # job → its round's deadline

    def __post_init__(self) -> None:
        self.agg_table, self.tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker",
                                                   "w3": "worker", "w4": "worker"})
        coord_table, people = token_table({"alice": "submitter", "bob": "viewer"})
        self.tokens.update(people)
        self.agg_server, port = serve_aggregator(RoundBook(max_update_bytes=MAX_UPDATE_BYTES), tokens=self.agg_table)
        self.target = f"127.0.0.1:{port}"
        self.agg = pb_grpc.AggregationStub(grpc.insecure_channel(self.target))
        self.as_coordinator = self.client("coordinator")
        self.bus = open_bus(self.rabbitmq_url, namespace=self.namespace)
        self.store = StateStore(str(self.tmp / "coordinator.sqlite"))
        self.coordinator = Coordinator(bus=self.bus, store=self.store, aggregator=self.as_coordinator,
                                       aggregator_target=self.target, checkpoint_dir=str(self.tmp / "checkpoints"),
                                       poll_interval_s=0.1)
        self.coordinator.start()
        self.bus.start()
        self.coord_server, cport = serve_coordinator(self.coordinator, tokens=coord_table)
        self.coord = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{cport}"))
        self.worker_bus = open_bus(self.rabbitmq_url, namespace=self.namespace)
        self.worker = WorkerAgent(WorkerConfig(id="wq", ledger_path=str(self.tmp / "wq.json"), device="cpu",
                                               heartbeat_s=60, dp=DPPolicy(enabled=False)), self.worker_bus)
        self.worker.start()
        self.worker_bus.start()
        self.sender = open_bus(self.rabbitmq_url, namespace=self.namespace)  # an intruder with broker access
        # accepted before any bad case: a job waiting for workers of a category nobody serves
        good = {"name": "accepted-before", "category": "nobody", "model": SPEC.to_dict(),
                "schedule": {"wait_for_workers_s": 3600}}
        self.good_job = self.coord.SubmitJob(pb.SubmitJobRequest(job_yaml=json.dumps(good)),
                                             metadata=bearer(self.tokens["alice"]), timeout=10).job_id
        self.good_row = asdict(self.store.job(self.good_job))

    def client(self, identity: str) -> AggregatorClient:
        return AggregatorClient(self.target, timeout_s=10, security=ClientSecurity(token=self.tokens[identity]))

    def dead_letters(self) -> int:
        connection = pika.BlockingConnection(pika.URLParameters(self.rabbitmq_url))
        try:
            return connection.channel().queue_declare(Topology(self.namespace).dead_queue,
                                                      passive=True).method.message_count
        finally:
            connection.close()

    def close(self) -> None:
        self.coordinator.stop()
        self.worker.stop()
        for bus in (self.worker_bus, self.bus, self.sender):
            bus.close()
        self.coord_server.stop(grace=0)
        self.agg_server.stop(grace=0)
        # every accepted registration declared its worker's task queue
        delete_topology(self.rabbitmq_url, self.namespace, ["wq", *(w.worker_id for w in self.store.workers())])


@pytest.fixture(scope="module")
def services(rabbitmq_url, tmp_path_factory):
    svc = Services(rabbitmq_url, tmp_path_factory.mktemp("hostile"))
    yield svc
    svc.close()


# ----- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    kind: str                     # "job", "upload" (or any aggregator call), "amqp"
    attack: Any                   # job text / fn(services, job_id) / (queue, body)
    code: grpc.StatusCode | None  # expected status (None: the call succeeds, e.g. a duplicate)
    text: str                     # expected in the details (or the dead letter's reason)
    counter: tuple[str, dict[str, str]]


def job_case(id: str, text_or_raw: Any, details: str, *, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
             token: str | None = "alice", reason: str = "invalid_config") -> Case:
    job = text_or_raw if isinstance(text_or_raw, str) else json.dumps(text_or_raw)
    return Case(id, "job", (job, token), code, details, (JOB_REJECTED, {"reason": reason}))


def good_job(**changes: Any) -> dict[str, Any]:
    job = {"name": "j", "category": "digits", "model": SPEC.to_dict()}
    job.update(changes)
    return job


def model_with(layer: dict[str, Any]) -> dict[str, Any]:
    return {"input_shape": [4], "layers": [layer]}


def alias_bomb(levels: int = 9) -> str:
    lines = ["name: bomb", "category: digits", "a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def merge_key_chain(target_bytes: int) -> str:
    lines = ["name: chain", "category: digits", "k0: &k0 {a0: 0}"]
    while sum(len(line) + 1 for line in lines) < target_bytes:
        i = len(lines) - 2
        lines.append(f"k{i}: &k{i} {{<<: *k{i - 1}, a{i}: {i}}}")
    return "\n".join(lines) + "\n"


JOB_CASES = [
    job_case("unknown-layer-type", good_job(model=model_with({"type": "Lambda", "fn": "os.system"})),
             "model.layers[0].type: unknown layer type 'Lambda'"),
    job_case("negative-width", good_job(model=model_with({"type": "Linear", "in_features": 4, "out_features": -3})),
             "model.layers[0].out_features: must be an integer in [1, 65536], got -3"),
    job_case("absurd-width", good_job(model=model_with({"type": "Linear", "in_features": 4,
                                                         "out_features": 10 ** 12})),
             "model.layers[0].out_features: must be an integer in [1, 65536]"),
    job_case("too-many-parameters", good_job(model={"input_shape": [65536], "layers": [
        {"type": "Linear", "in_features": 65536, "out_features": 65536}]}), "more than 200000000 parameters"),
    job_case("missing-model", {"name": "j", "category": "digits"}, "model: is required"),
    job_case("missing-name", {"category": "digits", "model": SPEC.to_dict()}, "name: is required"),
    job_case("wrong-type", good_job(training={"rounds": "five"}), "training.rounds: must be int, got str 'five'"),
    job_case("nan-learning-rate", "name: j\ncategory: digits\nmodel: " + json.dumps(SPEC.to_dict())
             + "\ntraining: {lr: .nan}\n", "training.lr: must be in"),
    job_case("oversized", good_job(category="digits", padding="x" * 300_000), "job: is larger than 262144 bytes"),
    job_case("alias-bomb", alias_bomb(), "job: uses more than 64 YAML aliases"),
    job_case("merge-key-chain", merge_key_chain(249_000), "job: uses more than 16 YAML merge keys"),  # was 52 s, 933 MB
    job_case("name-with-trailing-newline", good_job(name="j\n"), "name: is required"),
    job_case("unknown-evaluation-set", good_job(evaluation={"dataset": "nope"}),
             "evaluation.dataset: must be '' or 'digits'"),
    job_case("negative-split-seed", good_job(evaluation={"split_seed": -1}),
             "evaluation.split_seed: must be in [0, 4294967295], got -1"),
    job_case("evaluation-set-the-model-cannot-take", good_job(evaluation={"dataset": "digits"}),
             "evaluation.dataset: 'digits' has samples of shape [1, 8, 8] but model.input_shape is [4]"),
    job_case("huge-training-step", good_job(model={"input_shape": [4], "layers": [
        {"type": "Linear", "in_features": 4, "out_features": 60000}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 60000, "out_features": 2}]}, training={"batch_size": 65536}),
             "training.batch_size: 65536 makes one training step need"),
    job_case("deep-nesting", "name: j\ncategory: digits\nmodel: " + "[" * 5000 + "]" * 5000 + "\n",
             "nests deeper than"),
    job_case("not-a-mapping", "[1, 2, 3]", "job: must be a mapping, got list"),
    job_case("invalid-yaml", "name: [unclosed", "job: is not valid YAML/JSON"),
    job_case("python-object-tag", "!!python/object/apply:os.system ['true']", "job: is not valid YAML/JSON"),
    job_case("path-in-name", good_job(name="../../etc/cron.d/x"), "name: is required"),
    job_case("unknown-algorithm", good_job(aggregation={"weighting": "pickled"}),
             "aggregation.weighting: unknown weighting algorithm 'pickled'"),
    job_case("too-many-layers", good_job(model={"input_shape": [4], "layers": [{"type": "ReLU"}] * 200}),
             "has 200 layers, more than the limit of 128"),
    job_case("shape-mismatch", good_job(model=model_with({"type": "Linear", "in_features": 5, "out_features": 2})),
             "model.layers[0].in_features: is 5 but the previous layer outputs 4"),
    job_case("yaml-date-value", "name: j\ncategory: digits\nmodel: " + json.dumps(SPEC.to_dict())
             + "\ntraining: {rounds: 2024-01-01}\n", "training.rounds: must be plain data"),
    job_case("dunder-field", good_job(training={"__doc__": "x"}), "training.__doc__: unknown field"),
    job_case("no-token", good_job(), "needs a bearer token", code=grpc.StatusCode.UNAUTHENTICATED, token=None,
             reason="unauthenticated"),
    job_case("viewer-token", good_job(), "'bob' (role viewer) may not call SubmitJob",
             code=grpc.StatusCode.PERMISSION_DENIED, token="bob", reason="permission_denied"),
]


def stream(job: str, tensors: dict[str, np.ndarray], *, worker: str = "w1", rnd: int = 1, n: int = 5,
           edit_specs: Callable[[list[pb.TensorSpec]], None] | None = None) -> list[pb.UpdateChunk]:
    specs = codec.tensor_specs(tensors)
    if edit_specs is not None:
        edit_specs(specs)
    header = pb.UpdateHeader(job_id=job, round=rnd, worker_id=worker, num_samples=n, tensors=specs)
    messages = list(codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes=32))
    messages[0] = pb.UpdateChunk(header=header)
    return messages


def upload(svc: Services, messages: list[pb.UpdateChunk], token: str | None = "w1") -> pb.UploadReceipt:
    metadata = bearer(svc.tokens.get(token, token)) if token else ()
    return svc.agg.UploadUpdate(iter(messages), metadata=metadata, timeout=10)


def whole(job: str, tensors: dict[str, np.ndarray], *, worker: str = "w1", n: int = 5, data: bytes | None = None,
          sha256: str | None = None) -> pb.WholeUpdate:
    """An update in one message (what a worker sends for a small model), its bytes and digest replaceable."""
    header = pb.UpdateHeader(job_id=job, round=1, worker_id=worker, num_samples=n, tensors=codec.tensor_specs(tensors))
    return pb.WholeUpdate(header=header, data=codec.joined(tensors) if data is None else data,
                          sha256=codec.tensors_sha256(tensors) if sha256 is None else sha256)


def upload_whole(svc: Services, update: pb.WholeUpdate, token: str | None = "w1") -> pb.UploadReceipt:
    metadata = bearer(svc.tokens.get(token, token)) if token else ()
    return svc.agg.UploadWhole(update, metadata=metadata, timeout=10)


def with_(**changes: np.ndarray) -> dict[str, np.ndarray]:
    return {**weights(1.0), **changes}


def _set(index: int, **fields: Any) -> Callable[[list[pb.TensorSpec]], None]:
    def edit(specs: list[pb.TensorSpec]) -> None:
        for key, value in fields.items():
            if key == "shape":
                del specs[index].shape[:]
                specs[index].shape.extend(value)
            else:
                setattr(specs[index], key, value)
    return edit


def close_then_upload(svc: Services, job: str) -> Any:
    svc.as_coordinator.close_round(job, 1)
    return upload(svc, stream(job, weights(1.0)))


def late(svc: Services, job: str) -> Any:
    time.sleep(max(0.0, svc.deadlines[job] - time.time()) + 0.05)
    return upload(svc, stream(job, weights(1.0)))


def silent(release: threading.Event) -> Any:
    """An upload stream that sends nothing until `release` is set."""
    release.wait()
    return
    yield  # pragma: no cover


def beyond_the_stream_cap(svc: Services, job: str) -> Any:
    """w1 holds two silent uploads (its max_streams_per_worker), then tries a third, real one."""
    def streams() -> float:
        return metric("fedbroker_grpc_server_streams", grpc_service="fedbroker.v1.Aggregation")

    before = streams()
    release = threading.Event()
    held = [svc.agg.UploadUpdate.future(silent(release), metadata=bearer(svc.tokens["w1"]), timeout=30)
            for _ in range(2)]
    try:
        _wait(lambda: streams() == before + 2, "two silent streams to hold their threads")
        return upload(svc, stream(job, weights(1.0)))
    finally:
        for call in held:
            call.cancel()
        release.set()


def upload_case(id: str, attack: Callable[[Services, str], Any], code: grpc.StatusCode | None, text: str,
                reason: str | None = None, counter: tuple[str, dict[str, str]] | None = None) -> Case:
    return Case(id, "upload", attack, code, text, counter or (REJECTED, {"reason": reason or ""}))


def auth_case(id: str, attack: Callable[[Services, str], Any], method: str, code: grpc.StatusCode, text: str,
              reason: str) -> Case:
    return Case(id, "upload", attack, code, text,
                (AUTH_FAILED, {"grpc_service": "fedbroker.v1.Aggregation", "grpc_method": method, "reason": reason}))


S = grpc.StatusCode
UPLOAD_CASES = [
    upload_case("nan", lambda s, j: upload(s, stream(j, with_(**{"2.weight": np.full((2, 3), np.nan, np.float32)}))),
                S.INVALID_ARGUMENT, "tensor '2.weight' contains NaN or Inf", "non_finite"),
    upload_case("inf", lambda s, j: upload(s, stream(j, with_(**{"0.bias": np.array([0, np.inf, 0], np.float32)}))),
                S.INVALID_ARGUMENT, "tensor '0.bias' contains NaN or Inf", "non_finite"),
    upload_case("wrong-shape", lambda s, j: upload(s, stream(j, with_(**{"0.weight": np.ones((4, 3), np.float32)}))),
                S.INVALID_ARGUMENT, "'0.weight' has shape [4, 3], expected [3, 4]", "wrong_shape"),
    upload_case("wrong-dtype", lambda s, j: upload(s, stream(j, with_(**{"0.bias": np.ones(3, np.float64)}))),
                S.INVALID_ARGUMENT, "'0.bias' has dtype float64, expected float32", "wrong_dtype"),
    upload_case("object-dtype", lambda s, j: upload(s, stream(j, weights(1.0), edit_specs=_set(0, dtype="object"))),
                S.INVALID_ARGUMENT, "dtype 'object' is not one of", "wrong_dtype"),
    upload_case("unknown-tensor", lambda s, j: upload(s, stream(j, with_(**{"9.weight": np.ones(1, np.float32)}))),
                S.INVALID_ARGUMENT, "unknown tensor '9.weight'", "unknown_tensor"),
    upload_case("missing-tensor", lambda s, j: upload(s, stream(j, {k: v for k, v in weights(1.0).items()
                                                                    if k != "2.bias"})),
                S.INVALID_ARGUMENT, "tensor '2.bias' is missing", "missing_tensor"),
    upload_case("negative-dimension", lambda s, j: upload(s, stream(j, weights(1.0), edit_specs=_set(0, shape=[-3, 4]))),
                S.INVALID_ARGUMENT, "shape [-3, 4] is not a valid shape", "wrong_shape"),
    upload_case("empty-but-huge-shape",
                lambda s, j: upload(s, stream(j, weights(1.0), edit_specs=_set(0, shape=[0, 2 ** 62, 2 ** 62]))),
                S.INVALID_ARGUMENT, "is empty but has dimensions beyond", "wrong_shape"),
    upload_case("rank-too-high", lambda s, j: upload(s, stream(j, weights(1.0), edit_specs=_set(0, shape=[1] * 9))),
                S.INVALID_ARGUMENT, "is not a valid shape", "wrong_shape"),
    upload_case("repeated-tensor-name",
                lambda s, j: upload(s, stream(j, weights(1.0), edit_specs=_set(1, name="0.weight"))),
                S.INVALID_ARGUMENT, "tensor name '0.weight' is empty or repeated", "malformed_stream"),
    upload_case("truncated-no-trailer", lambda s, j: upload(s, stream(j, weights(1.0))[:-1]),
                S.INVALID_ARGUMENT, "the stream ended after 92 of 92 bytes (no trailer)", "truncated"),
    upload_case("truncated-mid-data", lambda s, j: upload(s, stream(j, weights(1.0))[:2]),
                S.INVALID_ARGUMENT, "the stream ended after 32 of 92 bytes", "truncated"),
    upload_case("over-the-size-limit",
                lambda s, j: upload(s, stream(j, {"0.weight": np.ones((100, 100), np.float32)})),
                S.RESOURCE_EXHAUSTED, "more than the 10000-byte limit", "too_large"),
    upload_case("more-bytes-than-announced",
                lambda s, j: upload(s, (lambda m: m[:-1] + [pb.UpdateChunk(data=b"\0" * 8), m[-1]])(
                    stream(j, weights(1.0)))),
                S.RESOURCE_EXHAUSTED, "more than the 92 bytes its header announced", "too_large"),
    upload_case("digest-mismatch",
                lambda s, j: upload(s, stream(j, weights(1.0))[:-1] + [pb.UpdateChunk(trailer=pb.Trailer(sha256="0" * 64))]),
                S.INVALID_ARGUMENT, "SHA-256 in the trailer does not match", "digest_mismatch"),
    upload_case("data-before-header", lambda s, j: upload(s, stream(j, weights(1.0))[1:]),
                S.INVALID_ARGUMENT, "must start with a header", "malformed_stream"),
    upload_case("empty-stream", lambda s, j: upload(s, []),
                S.INVALID_ARGUMENT, "must start with a header", "malformed_stream"),
    upload_case("message-after-trailer",
                lambda s, j: upload(s, stream(j, weights(1.0)) + [pb.UpdateChunk(data=b"\0")]),
                S.INVALID_ARGUMENT, "a message arrived after the trailer", "malformed_stream"),
    upload_case("zero-samples", lambda s, j: upload(s, stream(j, weights(1.0), n=0)),
                S.INVALID_ARGUMENT, "num_samples must be positive, got 0", "bad_header"),
    upload_case("negative-samples", lambda s, j: upload(s, stream(j, weights(1.0), n=-40)),
                S.INVALID_ARGUMENT, "num_samples must be positive, got -40", "bad_header"),
    upload_case("more-samples-than-registered",  # one claim of 10^15 samples set the global model (issue 12 #6)
                lambda s, j: upload(s, stream(j, weights(1000.0), n=10 ** 15)),
                S.INVALID_ARGUMENT, "claims 1000000000000000 samples, more than the 100 it registered",
                "too_many_samples"),
    upload_case("duplicate-upload", lambda s, j: upload(s, stream(j, weights(100.0), worker="w2"), token="w2"),
                None, "duplicate", counter=("fedbroker_aggregator_uploads_duplicate_total", {})),
    upload_case("closed-round", close_then_upload, S.FAILED_PRECONDITION, "round 1 of job", "round_closed"),
    upload_case("late", late, S.FAILED_PRECONDITION, "deadline passed; late update refused", "late"),
    # a round past the open one cannot come from the coordinator that opened it: from a state given up since
    upload_case("round-past-the-open-one", lambda s, j: upload(s, stream(j, weights(1.0), rnd=7)),
                S.FAILED_PRECONDITION, "round 7 of job", "round_closed"),
    upload_case("unknown-job", lambda s, j: upload(s, stream("no-such-job", weights(1.0))),
                S.NOT_FOUND, "unknown job 'no-such-job'", "unknown_job"),
    upload_case("unknown-worker", lambda s, j: upload(s, stream(j, weights(1.0), worker="w4"), token="w4"),
                S.PERMISSION_DENIED, "worker 'w4' is not a participant of round 1", "unknown_worker"),
    upload_case("another-workers-id", lambda s, j: upload(s, stream(j, weights(9.0), worker="w3"), token="w1"),
                S.PERMISSION_DENIED, "worker 'w1' may upload only its own update, not one for worker 'w3'",
                "permission_denied"),
    upload_case("wrong-token", lambda s, j: upload(s, stream(j, weights(1.0)), token="fbt_" + "A" * 43),
                S.UNAUTHENTICATED, "the bearer token is not valid for this service", "unauthenticated"),
    upload_case("missing-token", lambda s, j: upload(s, stream(j, weights(1.0)), token=None),
                S.UNAUTHENTICATED, "needs a bearer token: send 'authorization: Bearer <token>'", "unauthenticated"),
    upload_case("basic-auth-scheme",
                lambda s, j: s.agg.UploadUpdate(iter(stream(j, weights(1.0))),
                                                metadata=(("authorization", "Basic dzE6cGFzcw=="),), timeout=10),
                S.UNAUTHENTICATED, "the bearer token is not valid", "unauthenticated"),
    upload_case("coordinator-token-uploads",
                lambda s, j: upload(s, stream(j, weights(1.0), worker="coordinator"), token="coordinator"),
                S.PERMISSION_DENIED, "'coordinator' (role coordinator) may not call UploadUpdate", "permission_denied"),
    upload_case("more-streams-than-a-worker-may-hold", beyond_the_stream_cap, S.RESOURCE_EXHAUSTED,
                "'w1' already has 2 streams open", "too_many_streams"),
    # the same checks on an update sent in one message (UploadWhole, a worker's path for a small model)
    upload_case("whole-nan",
                lambda s, j: upload_whole(s, whole(j, with_(**{"2.weight": np.full((2, 3), np.nan, np.float32)}))),
                S.INVALID_ARGUMENT, "tensor '2.weight' contains NaN or Inf", "non_finite"),
    upload_case("whole-wrong-shape",
                lambda s, j: upload_whole(s, whole(j, with_(**{"0.weight": np.ones((4, 3), np.float32)}))),
                S.INVALID_ARGUMENT, "'0.weight' has shape [4, 3], expected [3, 4]", "wrong_shape"),
    upload_case("whole-fewer-bytes-than-announced",
                lambda s, j: upload_whole(s, whole(j, weights(1.0), data=codec.joined(weights(1.0))[:60])),
                S.INVALID_ARGUMENT, "the stream ended after 60 of 92 bytes", "truncated"),
    upload_case("whole-more-bytes-than-announced",
                lambda s, j: upload_whole(s, whole(j, weights(1.0), data=codec.joined(weights(1.0)) + b"\0" * 8)),
                S.RESOURCE_EXHAUSTED, "more than the 92 bytes its header announced", "too_large"),
    upload_case("whole-digest-mismatch", lambda s, j: upload_whole(s, whole(j, weights(1.0), sha256="0" * 64)),
                S.INVALID_ARGUMENT, "SHA-256 in the trailer does not match", "digest_mismatch"),
    upload_case("whole-over-the-size-limit",
                lambda s, j: upload_whole(s, whole(j, {"0.weight": np.ones((100, 100), np.float32)})),
                S.RESOURCE_EXHAUSTED, "more than the 10000-byte limit", "too_large"),
    upload_case("whole-another-workers-id", lambda s, j: upload_whole(s, whole(j, weights(9.0), worker="w3")),
                S.PERMISSION_DENIED, "worker 'w1' may upload only its own update, not one for worker 'w3'",
                "permission_denied"),
    upload_case("whole-unknown-worker", lambda s, j: upload_whole(s, whole(j, weights(1.0), worker="w4"), token="w4"),
                S.PERMISSION_DENIED, "worker 'w4' is not a participant of round 1", "unknown_worker"),
    upload_case("whole-duplicate", lambda s, j: upload_whole(s, whole(j, weights(100.0), worker="w2"), token="w2"),
                None, "duplicate", counter=("fedbroker_aggregator_uploads_duplicate_total", {})),
    upload_case("whole-missing-token", lambda s, j: upload_whole(s, whole(j, weights(1.0)), token=None),
                S.UNAUTHENTICATED, "needs a bearer token: send 'authorization: Bearer <token>'", "unauthenticated"),
    auth_case("coordinator-token-uploads-whole",
              lambda s, j: upload_whole(s, whole(j, weights(1.0), worker="coordinator"), token="coordinator"),
              "UploadWhole", S.PERMISSION_DENIED, "'coordinator' (role coordinator) may not call UploadWhole",
              "permission_denied"),
    auth_case("worker-opens-a-round",
              lambda s, j: s.agg.OpenRound(pb.OpenRoundRequest(job_id=j, round=2, participants=["w1"],
                                                               deadline_unix=4e9, aggregation_json="{}"),
                                           metadata=bearer(s.tokens["w1"]), timeout=10),
              "OpenRound", S.PERMISSION_DENIED, "'w1' (role worker) may not call OpenRound", "permission_denied"),
    auth_case("worker-closes-the-round",
              lambda s, j: s.agg.CloseRound(pb.CloseRoundRequest(job_id=j, round=1), metadata=bearer(s.tokens["w1"]),
                                            timeout=10),
              "CloseRound", S.PERMISSION_DENIED, "may not call CloseRound", "permission_denied"),
    auth_case("worker-replaces-the-global-model",
              lambda s, j: s.agg.PutGlobalModel(iter(codec.stream_messages(pb.ModelChunk, pb.ModelHeader(
                  job_id=j, version=1, model_spec_json=SPEC.to_json(), tensors=codec.tensor_specs(weights(7.0))),
                  weights(7.0))), metadata=bearer(s.tokens["w1"]), timeout=10),
              "PutGlobalModel", S.PERMISSION_DENIED, "may not call PutGlobalModel", "permission_denied"),
    auth_case("anonymous-download",
              lambda s, j: list(s.agg.DownloadGlobalModel(pb.GlobalModelRequest(job_id=j), timeout=10)),
              "DownloadGlobalModel", S.UNAUTHENTICATED, "needs a bearer token", "unauthenticated"),
]

def valid_registration(**fields: Any) -> pb.Registration:
    """A registration a worker could send, with `fields` replaced."""
    values: dict[str, Any] = {"worker_id": "wr", "categories": ["x"], "label_histogram": [3, 4], "device": "cpu",
                              "num_samples": 7, **fields}
    return pb.Registration(**values)


AMQP_CASES = [
    Case("control-garbage", "amqp", ("control", b"\xff\x00 not a protobuf"), None, "is not a fedbroker Envelope",
         ("fedbroker_coordinator_control_messages_rejected_total", {"reason": "malformed_message"})),
    Case("control-empty-envelope", "amqp", ("control", b""), None, "an empty envelope",
         ("fedbroker_coordinator_control_messages_rejected_total", {"reason": "malformed_message"})),
    Case("control-wrong-kind", "amqp", ("control", envelope.encode(round_task=pb.RoundTask(job_id="x"))), None,
         "got round_task", ("fedbroker_coordinator_control_messages_rejected_total", {"reason": "malformed_message"})),
    *(Case(f"control-{name}", "amqp", ("control", envelope.encode(**{kind: message})), None, text,
           ("fedbroker_coordinator_control_messages_rejected_total", {"reason": f"invalid_{kind}"}))
      for name, kind, message, text in [
          # issue 12 #4: a stored 'evil id' failed a running job when it was selected and its task unroutable
          ("registration-unroutable-worker-id", "registration", valid_registration(worker_id="evil id"),
           "worker_id: must be 1-128 characters"),
          ("registration-worker-id-with-trailing-newline", "registration", valid_registration(worker_id="w1\n"),
           "worker_id: must be 1-128 characters"),
          ("registration-10e15-samples", "registration", valid_registration(num_samples=10**15),
           "num_samples: must lie in [1, 1000000000], got 1000000000000000"),
          ("registration-negative-label-count", "registration", valid_registration(label_histogram=[5, -3]),
           "label_histogram: every count must lie in [0, 1000000000]"),
          ("registration-huge-histogram", "registration", valid_registration(label_histogram=[1] * 70_000),
           "label_histogram: at most 65536 classes, got 70000"),
          ("registration-nan-epsilon-budget", "registration", valid_registration(
              dp_enabled=True, dp_policy=pb.DPPolicy(noise_multiplier=1, max_grad_norm=1, delta=1e-5,
                                                     epsilon_budget=float("nan"))),
           "dp_policy: every number must be finite"),
          ("registration-no-category", "registration", valid_registration(categories=[]),
           "categories: must list 1 to 64 categories, got 0"),
          ("heartbeat-nan-epsilon", "heartbeat", pb.Heartbeat(worker_id="wq", epsilon_spent=float("nan"), state="idle"),
           "epsilon_spent: must be a finite number >= 0, got nan"),
          ("heartbeat-unknown-state", "heartbeat", pb.Heartbeat(worker_id="wq", state="x" * 500),
           "state: must be one of idle, training, uploading"),
          ("heartbeat-nan-epsilon-left", "heartbeat", pb.Heartbeat(worker_id="wq", state="idle", budget_limited=True,
                                                                   epsilon_left=float("nan")),
           "epsilon_left: must be a finite number, got nan"),   # a NaN would compare as affordable
          ("heartbeat-negative-round-cost", "heartbeat", pb.Heartbeat(
              worker_id="wq", state="idle", budget_limited=True, epsilon_left=1.0,
              job_costs=[pb.JobCost(job_id="j-1", known=True, next_round_epsilon=-1.0)]),
           "job_costs[].next_round_epsilon: must be a finite number >= 0, got -1.0"),
          ("heartbeat-bad-job-id-in-costs", "heartbeat", pb.Heartbeat(
              worker_id="wq", state="idle", job_costs=[pb.JobCost(job_id="../x\n")]),
           "job_costs[0].job_id: must be a job id"),
          ("outcome-without-status", "task_outcome", pb.TaskOutcome(job_id="j-1", round=1, worker_id="wq"),
           "status: must be REFUSED, FAILED or UPLOADED, got 0"),
          ("outcome-round-zero", "task_outcome", pb.TaskOutcome(job_id="j-1", round=0, worker_id="wq",
                                                                 status=pb.TaskOutcome.FAILED),
           "round: must be >= 1, got 0"),
      ]),
    Case("task-garbage", "amqp", ("task", b"\x08\x96\x01 truncated \xff"), None, "not a fedbroker Envelope",
         ("fedbroker_worker_tasks_total", {"worker_id": "wq", "outcome": "malformed"})),
    Case("task-wrong-kind", "amqp", ("task", envelope.encode(heartbeat=pb.Heartbeat(worker_id="wq"))), None,
         "got heartbeat", ("fedbroker_worker_tasks_total", {"worker_id": "wq", "outcome": "malformed"})),
]

CASES = JOB_CASES + UPLOAD_CASES + AMQP_CASES


def test_the_table_is_large_and_every_case_is_named_once():
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input_is_refused_by_name_counted_and_loses_nothing(services, case, caplog):
    counter_before = metric(case.counter[0], **case.counter[1])
    {"job": _job, "upload": _upload, "amqp": _amqp}[case.kind](services, case, caplog)
    assert metric(case.counter[0], **case.counter[1]) == counter_before + 1, case.counter


def _expect(case: Case, call: Callable[[], Any]) -> Any:
    if case.code is None:
        return call()
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == case.code, (error.code(), error.details())
    assert case.text in error.details(), error.details()
    assert len(error.details()) <= 2100
    return error


def _job(svc: Services, case: Case, caplog: Any) -> None:
    text, token = case.attack
    jobs = len(svc.store.jobs())
    _expect(case, lambda: svc.coord.SubmitJob(pb.SubmitJobRequest(job_yaml=text),
                                              metadata=bearer(svc.tokens[token]) if token else (), timeout=30))
    assert len(svc.store.jobs()) == jobs
    assert asdict(svc.store.job(svc.good_job)) | {"status": None} == svc.good_row | {"status": None}


def _upload(svc: Services, case: Case, caplog: Any) -> None:
    job = f"h-{case.id}-{uuid.uuid4().hex[:6]}"
    deadline = time.time() + (0.5 if case.id == "late" else 60)
    svc.deadlines[job] = deadline
    svc.as_coordinator.put_global(job, 1, SPEC.to_json(), weights(0.0))
    install(svc.as_coordinator, job, AGG)
    svc.as_coordinator.open_round(job, 1, PARTICIPANTS, deadline, seed=0,
                                  num_samples={w: REGISTERED_SAMPLES for w in PARTICIPANTS})
    accepted = svc.client("w2").upload(job_id=job, round=1, worker_id="w2", num_samples=5, tensors=weights(2.0))
    assert not accepted.duplicate
    reply = _expect(case, lambda: case.attack(svc, job))
    if case.code is None:
        assert reply.duplicate and reply.sha256 == accepted.sha256
    else:
        reason = dict(reply.trailing_metadata() or ()).get("fedbroker-reason")
        assert reason == case.counter[1].get("reason", reason), reason
    accepted_now, is_open = svc.as_coordinator.status(job, 1)
    if is_open:
        assert accepted_now == ["w2"]
        assert list(svc.as_coordinator.close_round(job, 1).aggregated) == ["w2"]
    version, _, state = svc.as_coordinator.download(job)
    assert version == 2
    for name, array in state.items():
        np.testing.assert_array_equal(array, np.full_like(array, 2.0), err_msg=name)


def _amqp(svc: Services, case: Case, caplog: Any) -> None:
    where, body = case.attack
    dead = svc.dead_letters()
    received = metric("fedbroker_worker_tasks_received_total", worker_id="wq")
    if where == "control":
        svc.sender.publish_control(body)
    else:
        svc.sender.publish_task("wq", body)
    _wait(lambda: svc.dead_letters() == dead + 1, "the message to be dead-lettered")
    time.sleep(0.3)  # a message that looped would be redelivered and counted again by now
    assert svc.dead_letters() == dead + 1
    assert case.text in caplog.text
    if where == "task":
        assert metric("fedbroker_worker_tasks_received_total", worker_id="wq") == received + 1
    # the consumers still consume: a registration reaches the registry, a task the worker
    probe = f"probe-{uuid.uuid4().hex[:6]}"
    svc.sender.publish_control(envelope.encode(registration=pb.Registration(worker_id=probe, categories=["x"], num_samples=10,
                                                                            device="cpu")))
    _wait(lambda: any(w.worker_id == probe for w in svc.store.workers()), "the coordinator to register a probe")
    refused = metric("fedbroker_worker_tasks_total", worker_id="wq", outcome="refused")
    svc.sender.publish_task("wq", envelope.encode(round_task=pb.RoundTask(job_id="probe", round=1, category="nope")))
    _wait(lambda: metric("fedbroker_worker_tasks_total", worker_id="wq", outcome="refused") == refused + 1,
          "the worker to refuse a probe task")


def _wait(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("message", ["registration", "heartbeat"])
def test_a_control_message_reporting_less_epsilon_is_counted_and_never_lowers_the_record(services, message):
    """Issue 12 #7: a worker's recorded ε fell from 3.93 to 2.85 without a word (a lost ledger, or anyone who
    can publish on the control queue). The record (what the coordinator priced, here an audited correction) never
    falls by a report; the lower report is logged and counted."""
    svc = services
    worker_id = f"victim-{message}-{uuid.uuid4().hex[:6]}"
    svc.sender.publish_control(envelope.encode(registration=pb.Registration(
        worker_id=worker_id, categories=["x"], epsilon_spent=3.93, num_samples=10, device="cpu")))
    _wait(lambda: svc.store.recorded_epsilon(worker_id) == 0.0, "the worker's registration")  # a claim: not stored
    svc.store.correct_epsilon(worker_id, epsilon=3.93, by="op", ledger_sha256="00", ledger_epsilon=3.93)
    counter = ("fedbroker_coordinator_epsilon_decreases_total", {"message": message})
    before = metric(counter[0], **counter[1])
    lower = (pb.Registration(worker_id=worker_id, categories=["x"], epsilon_spent=2.85, num_samples=10,
                                     device="cpu") if message == "registration"
             else pb.Heartbeat(worker_id=worker_id, epsilon_spent=2.85, state="idle"))
    svc.sender.publish_control(envelope.encode(**{message: lower}))
    _wait(lambda: metric(counter[0], **counter[1]) == before + 1, "the lower ε to be counted")
    assert svc.store.recorded_epsilon(worker_id) == 3.93
