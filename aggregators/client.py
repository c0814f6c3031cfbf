"""A client of the aggregation service, used by workers and the coordinator: deadlines on every call,
retries only where repeating is safe."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import grpc
import numpy as np

from fedbroker import codec
from fedbroker.rpc import CHANNEL_OPTIONS, call_with_retry
from proto import fedbroker_pb2 as pb
from proto import fedbroker_pb2_grpc as pb_grpc


class AggregatorClient:
    def __init__(self, target: str, *, timeout_s: float = 30.0, transfer_timeout_s: float = 600.0,
                 max_model_bytes: int = 1 << 30) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.max_model_bytes = max_model_bytes
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.AggregationStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "AggregatorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put_global(self, job_id: str, version: int, spec_json: str, tensors: Mapping[str, np.ndarray]) -> None:
        header = pb.ModelHeader(job_id=job_id, version=version, model_spec_json=spec_json,
                                tensors=codec.tensor_specs(tensors))
        call_with_retry(
            lambda: self._stub.PutGlobalModel(codec.stream_messages(pb.ModelChunk, header, tensors),
                                              timeout=self.transfer_timeout_s),
            what=f"put global model of job {job_id}", idempotent=True,
        )

    def download(self, job_id: str, version: int = 0) -> tuple[int, str, dict[str, np.ndarray]]:
        def run() -> tuple[int, str, dict[str, np.ndarray]]:
            stream = self._stub.DownloadGlobalModel(pb.GlobalModelRequest(job_id=job_id, version=version),
                                                    timeout=self.transfer_timeout_s)
            header, tensors, _ = codec.receive(stream, max_bytes=self.max_model_bytes)
            return header.version, header.model_spec_json, tensors

        return call_with_retry(run, what=f"download global model of job {job_id}", idempotent=True)

    def upload(self, *, job_id: str, round: int, worker_id: str, num_samples: int, tensors: Mapping[str, np.ndarray],
               ish: float | None = None, epsilon: float = 0.0, train_loss: float = 0.0,
               validation_loss: float = 0.0) -> pb.UploadReceipt:
        """Upload is idempotent on (job, round, worker) at the service, so retrying it is safe."""
        header = pb.UpdateHeader(
            job_id=job_id, round=round, worker_id=worker_id, num_samples=num_samples,
            ish=ish or 0.0, has_ish=ish is not None, epsilon=epsilon, train_loss=train_loss,
            validation_loss=validation_loss, tensors=codec.tensor_specs(tensors),
        )
        return call_with_retry(
            lambda: self._stub.UploadUpdate(codec.stream_messages(pb.UpdateChunk, header, tensors),
                                            timeout=self.transfer_timeout_s),
            what=f"upload of {worker_id} for round {round}", idempotent=True,
        )

    def open_round(self, job_id: str, round: int, participants: Sequence[str], deadline_unix: float,
                   aggregation: Mapping[str, Any], *, seed: int,
                   histograms: Mapping[str, Sequence[int]] | None = None) -> int:
        request = pb.OpenRoundRequest(
            job_id=job_id, round=round, participants=list(participants), deadline_unix=deadline_unix,
            aggregation_json=json.dumps(dict(aggregation)), seed=seed,
            histograms={w: pb.LabelHistogram(counts=list(h)) for w, h in (histograms or {}).items()},
        )
        reply = call_with_retry(lambda: self._stub.OpenRound(request, timeout=self.timeout_s),
                                what=f"open round {round}", idempotent=True)
        return reply.model_version

    def status(self, job_id: str, round: int) -> tuple[list[str], bool]:
        reply = call_with_retry(
            lambda: self._stub.RoundStatus(pb.RoundStatusRequest(job_id=job_id, round=round), timeout=self.timeout_s),
            what=f"status of round {round}", idempotent=True,
        )
        return list(reply.accepted), reply.open

    def close_round(self, job_id: str, round: int, *, timeout_s: float = 600.0) -> pb.CloseRoundReply:
        # Not idempotent: a retry after a lost reply finds the round closed, so only UNAVAILABLE is retried.
        return call_with_retry(
            lambda: self._stub.CloseRound(pb.CloseRoundRequest(job_id=job_id, round=round), timeout=timeout_s),
            what=f"close round {round}", idempotent=False,
        )
