"""SHA-256 in a helper thread (large models) gives the same digests and verdicts as hashing inline."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from fedbroker.errors import UploadRejected
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec


@pytest.fixture(params=[0, 1 << 40], ids=["threaded", "inline"])
def hash_threshold(request, monkeypatch):
    monkeypatch.setattr(codec, "HASH_THREAD_BYTES", request.param)
    return request.param


def stream(tensors, chunk_bytes=7):
    header = pb.UpdateHeader(job_id="j", round=1, worker_id="w", num_samples=1, tensors=codec.tensor_specs(tensors))
    return list(codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes))


TENSORS = {"a": np.arange(10, dtype=np.float32).reshape(2, 5), "empty": np.zeros(0, np.float32),
           "b": np.arange(7, dtype=">f8"), "c": np.arange(12, dtype=np.int64)[::2]}


def test_digest_is_the_sha256_of_the_concatenated_bytes(hash_threshold):
    messages = stream(TENSORS)
    expected = hashlib.sha256(b"".join(codec.iter_chunks(TENSORS))).hexdigest()
    assert messages[-1].trailer.sha256 == expected
    _, out, digest = codec.receive(messages, max_bytes=1 << 20)
    assert digest == expected
    for name, arr in TENSORS.items():
        np.testing.assert_array_equal(out[name], arr)


def test_a_changed_byte_is_a_digest_mismatch(hash_threshold):
    messages = stream(TENSORS)
    data = bytearray(messages[2].data)
    data[0] ^= 1
    messages[2] = pb.UpdateChunk(data=bytes(data))
    with pytest.raises(UploadRejected) as info:
        codec.receive(messages, max_bytes=1 << 20)
    assert info.value.reason == "digest_mismatch"


def test_a_rejected_stream_leaves_no_hashing_thread(hash_threshold):
    before = {t.ident for t in threading.enumerate()}
    messages = stream(TENSORS)
    for broken in (messages[:-1], messages[:3] + [messages[0]], messages + [messages[1]]):
        with pytest.raises(UploadRejected):
            codec.receive(broken, max_bytes=1 << 20)
    sender = codec.stream_messages(pb.UpdateChunk, messages[0].header, TENSORS, 7)
    next(sender), next(sender)
    sender.close()  # a cancelled upload
    assert {t.ident for t in threading.enumerate() if t.name == "sha256"} <= before


def test_encoded_stream_is_byte_for_byte_the_serialized_messages(hash_threshold):
    header = pb.UpdateHeader(job_id="j", round=1, worker_id="w", num_samples=1, tensors=codec.tensor_specs(TENSORS))
    for chunk in (1, 7, 64, 1 << 20):
        expected = [m.SerializeToString() for m in codec.stream_messages(pb.UpdateChunk, header, TENSORS, chunk)]
        assert list(codec.encoded_stream(pb.UpdateChunk, header, TENSORS, chunk)) == expected


def test_decoded_stream_gives_receive_the_same_model(hash_threshold):
    big = {"w": np.arange(70_000, dtype=np.float32)}  # chunks of 2^16 bytes: three-byte length varints
    for tensors, chunk in ((TENSORS, 7), (big, 1 << 16)):
        header = pb.ModelHeader(job_id="j", version=3, tensors=codec.tensor_specs(tensors))
        raw = list(codec.encoded_stream(pb.ModelChunk, header, tensors, chunk))
        got_header, out, digest = codec.receive(codec.decoded_stream(raw, pb.ModelChunk), max_bytes=1 << 20)
        assert got_header.version == 3 and digest == pb.ModelChunk.FromString(raw[-1]).trailer.sha256
        for name, arr in tensors.items():
            np.testing.assert_array_equal(out[name], arr)


def test_a_data_message_with_another_field_is_parsed_in_full():
    message = pb.UpdateChunk(data=b"abc").SerializeToString() + pb.UpdateChunk(
        trailer=pb.Trailer(sha256="x")).SerializeToString()  # concatenated: the last oneof field wins
    (parsed,) = codec.decoded_stream([message], pb.UpdateChunk)
    assert parsed.WhichOneof("part") == "trailer"


def test_tensors_sha256_is_the_trailer_digest(hash_threshold):
    header = pb.ModelHeader(job_id="j", version=1, tensors=codec.tensor_specs(TENSORS))
    raw = list(codec.encoded_stream(pb.ModelChunk, header, TENSORS, 7))
    assert codec.tensors_sha256(TENSORS) == pb.ModelChunk.FromString(raw[-1]).trailer.sha256


def test_a_digest_given_by_the_caller_sends_the_same_bytes_and_hashes_nothing(hash_threshold, monkeypatch):
    header = pb.ModelHeader(job_id="j", version=1, tensors=codec.tensor_specs(TENSORS))
    hashed = list(codec.encoded_stream(pb.ModelChunk, header, TENSORS, 7))
    known = codec.tensors_sha256(TENSORS)

    def no_hashing(*_: object) -> None:
        raise AssertionError("a stream given its digest hashed")

    monkeypatch.setattr(codec, "_BackgroundHash", no_hashing)
    monkeypatch.setattr(codec.hashlib, "sha256", no_hashing)
    asked: list[int] = []
    given = list(codec.encoded_stream(pb.ModelChunk, header, TENSORS, 7, sha256=lambda: asked.append(1) or known))
    assert given == hashed and asked == [1]
