"""AggregatorClient's hand-framed model streams against the real service on loopback gRPC."""

from __future__ import annotations

import hashlib
import json
import time

import grpc
import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc import codec
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.installed import install

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def client():
    server, port = serve(RoundBook())
    with AggregatorClient(f"127.0.0.1:{port}") as c:
        yield c
    server.stop(grace=0)


@pytest.mark.parametrize("width", [3, 1500])  # 12 values; 9 MB (hashed in a helper thread)
def test_put_download_upload_round_trip(client, width):
    spec = {"input_shape": [width], "layers": [{"type": "Linear", "in_features": width, "out_features": width}]}
    rng = np.random.default_rng(width)
    model = {"0.weight": rng.standard_normal((width, width), dtype=np.float32),
             "0.bias": rng.standard_normal(width, dtype=np.float32)}
    client.put_global("j", 1, json.dumps(spec), model)
    for _ in range(2):  # the second download sends the digest the first one computed
        version, spec_json, got = client.download("j")
        assert version == 1 and json.loads(spec_json) == spec
        for name, arr in model.items():
            np.testing.assert_array_equal(got[name], arr)
    install(client, "j", {})
    client.open_round("j", 1, ["w1"], time.time() + 60, seed=0)
    update = {name: arr + np.float32(1.0) for name, arr in model.items()}
    receipt = client.upload(job_id="j", round=1, worker_id="w1", num_samples=5, tensors=update)
    assert receipt.sha256 == hashlib.sha256(b"".join(codec.iter_chunks(update))).hexdigest()
    assert not receipt.duplicate and receipt.bytes_received == sum(a.nbytes for a in update.values())
    assert client.close_round("j", 1).model_version == 2
    _, _, merged = client.download("j", 2)
    for name, arr in update.items():
        np.testing.assert_allclose(merged[name], arr, rtol=1e-6)


def test_the_generated_stub_reads_the_pre_serialized_download(client):
    """DownloadGlobalModel yields serialized messages with no response serializer: the wire stays protobuf."""
    model = {"0.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "0.bias": np.ones(2, np.float32)}
    spec = {"input_shape": [3], "layers": [{"type": "Linear", "in_features": 3, "out_features": 2}]}
    client.put_global("j", 4, json.dumps(spec), model)
    with grpc.insecure_channel(client.target) as channel:
        stub = pb_grpc.AggregationStub(channel)
        messages = list(stub.DownloadGlobalModel(pb.GlobalModelRequest(job_id="j"), timeout=10))
    header, got, digest = codec.receive(messages, max_bytes=1 << 20)
    assert header.version == 4 and digest == hashlib.sha256(b"".join(codec.iter_chunks(model))).hexdigest()
    for name, arr in model.items():
        np.testing.assert_array_equal(got[name], arr)
