"""The tensor wire format: exact round trips, and every malformed stream refused by name."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.errors import UploadRejected
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec


def _stream(tensors, chunk_bytes=codec.CHUNK_BYTES):
    header = pb.UpdateHeader(job_id="j", round=1, worker_id="w", num_samples=1, tensors=codec.tensor_specs(tensors))
    return list(codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes))


def test_round_trip_preserves_names_shapes_dtypes_and_values():
    rng = np.random.default_rng(0)
    tensors = {"0.weight": rng.normal(size=(5, 3)).astype(np.float32), "0.bias": np.arange(5, dtype=np.float64),
               "steps": np.array([3], dtype=np.int64)}
    _header, out, digest = codec.receive(_stream(tensors, chunk_bytes=7), max_bytes=1 << 20)
    assert list(out) == list(tensors)
    for name in tensors:
        assert out[name].dtype == tensors[name].dtype
        np.testing.assert_array_equal(out[name], tensors[name])
    assert digest == hashlib.sha256(b"".join(codec.iter_chunks(tensors))).hexdigest()


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=5), chunk=st.integers(1, 97))
def test_chunking_is_exact_for_any_sizes_and_chunk_lengths(sizes, chunk):
    tensors = {f"t{i}": np.arange(n, dtype=np.float32) * (i + 1) for i, n in enumerate(sizes)}
    pieces = list(codec.iter_chunks(tensors, chunk))
    assert all(len(p) == chunk for p in pieces[:-1])
    _, out, _ = codec.receive(_stream(tensors, chunk), max_bytes=1 << 20)
    for name, arr in tensors.items():
        np.testing.assert_array_equal(out[name], arr)


def test_big_endian_input_travels_little_endian():
    arr = np.arange(6, dtype=">f4").reshape(2, 3)
    _, out, _ = codec.receive(_stream({"x": arr}), max_bytes=1 << 20)
    np.testing.assert_array_equal(out["x"], arr.astype("<f4"))


def _reason(messages, max_bytes=1 << 20):
    with pytest.raises(UploadRejected) as info:
        codec.receive(messages, max_bytes=max_bytes)
    return info.value.reason, str(info.value)


def test_stream_without_header_is_malformed():
    msgs = _stream({"x": np.ones(4, np.float32)})
    assert _reason(msgs[1:])[0] == "malformed_stream"


def test_truncated_stream_is_refused():
    msgs = _stream({"x": np.ones(1000, np.float32)}, chunk_bytes=512)
    reason, message = _reason(msgs[:3])
    assert reason == "truncated" and "of 4000 bytes" in message


def test_stream_missing_only_its_trailer_is_truncated():
    msgs = _stream({"x": np.ones(10, np.float32)})
    assert _reason(msgs[:-1])[0] == "truncated"


def test_oversized_header_is_refused_before_any_data():
    msgs = iter(_stream({"x": np.ones(1000, np.float32)}))
    reason, _message = _reason(msgs, max_bytes=3999)
    assert reason == "too_large"
    assert next(msgs).WhichOneof("part") == "data"  # nothing beyond the header was consumed


def test_extra_bytes_beyond_the_header_are_refused():
    msgs = _stream({"x": np.ones(4, np.float32)})
    msgs.insert(2, pb.UpdateChunk(data=b"\x00" * 4))
    assert _reason(msgs)[0] == "too_large"


def test_corrupted_bytes_fail_the_digest():
    msgs = _stream({"x": np.ones(4, np.float32)})
    msgs[1] = pb.UpdateChunk(data=b"\x00" * 16)
    assert _reason(msgs)[0] == "digest_mismatch"


def test_message_after_trailer_is_refused():
    msgs = _stream({"x": np.ones(4, np.float32)})
    msgs.append(pb.UpdateChunk(data=b"x"))
    assert _reason(msgs)[0] == "malformed_stream"


@pytest.mark.parametrize(
    "spec, reason",
    [
        (pb.TensorSpec(name="x", dtype="object", shape=[2]), "wrong_dtype"),
        (pb.TensorSpec(name="x", dtype="float32", shape=[-1]), "wrong_shape"),
        (pb.TensorSpec(name="", dtype="float32", shape=[1]), "malformed_stream"),
        (pb.TensorSpec(name="x", dtype="float32", shape=[1 << 40, 1 << 40]), "too_large"),
    ],
)
def test_bad_tensor_headers_are_refused_by_name(spec, reason):
    msgs = [pb.UpdateChunk(header=pb.UpdateHeader(tensors=[spec])), pb.UpdateChunk(trailer=pb.Trailer())]
    assert _reason(msgs)[0] == reason


def test_repeated_tensor_name_is_refused():
    specs = [pb.TensorSpec(name="x", dtype="float32", shape=[1])] * 2
    assert _reason([pb.UpdateChunk(header=pb.UpdateHeader(tensors=specs))])[0] == "malformed_stream"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_fuzzed_streams_never_crash_the_decoder(blobs):
    """Arbitrary bytes as messages: either a clean UploadRejected or a valid decode, never another error."""
    messages = []
    for blob in blobs:
        m = pb.UpdateChunk()
        try:
            m.ParseFromString(blob)
        except Exception:
            m = pb.UpdateChunk(data=blob)
        messages.append(m)
    try:
        codec.receive(messages, max_bytes=1 << 16)
    except UploadRejected:
        pass
