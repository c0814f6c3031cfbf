"""Fuzzing the two parsers that take input from outside: the upload decoder (codec.receive, on arbitrary
message sequences) and the job-spec parser (parse_job on arbitrary nested values, job_from_text on arbitrary
text). Whatever comes in, only UploadRejected or ConfigError may come out: any other exception would reach
a client as an opaque UNKNOWN status, or kill a thread. Bounded: each runs a fixed number of examples
(about 10-20 s on a small CI machine).

Found and fixed by these: an empty tensor with a huge dimension (numpy refused to shape it), non-text
mapping keys and dataclass attributes such as `__doc__` taken as job fields (TypeError), YAML dates and
invalid dates (TypeError/ValueError), deep nesting (RecursionError) and alias bombs (minutes of CPU)."""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import string
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedbroker.errors import ConfigError, UploadRejected
from fedbroker.job.spec import job_from_text, parse_job
from fedbroker.job.submission import accept_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ----- codec.receive ---------------------------------------------------------------------------------

DTYPES = sorted(codec.ALLOWED_DTYPES) + ["object", "float128", "", "<f4", "bool", "V8", "S4", "complex64", "int8"]
DIMENSION = st.one_of(st.integers(0, 5), st.integers(-3, 3), st.integers(-(2 ** 63), 2 ** 63 - 1),
                      st.sampled_from([2 ** 31, 2 ** 62, 2 ** 63 - 1]))


@st.composite
def tensor_spec(draw: Any) -> pb.TensorSpec:
    return pb.TensorSpec(name=draw(st.text(string.ascii_letters + "._0", max_size=6)), dtype=draw(st.sampled_from(DTYPES)),
                         shape=draw(st.lists(DIMENSION, max_size=10)))


@st.composite
def arrays(draw: Any) -> dict[str, np.ndarray]:
    out = {}
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(sorted(codec.ALLOWED_DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        out[f"{i}.w"] = np.asarray(draw(st.lists(st.floats(allow_nan=True, width=16) if "float" in dtype
                                                 else st.integers(0 if dtype.startswith("uint") else -100, 100),
                                                 min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                                   dtype=dtype).reshape(shape)
    return out


MESSAGE = st.one_of(
    st.builds(lambda specs: pb.UpdateChunk(header=pb.UpdateHeader(job_id="j", worker_id="w", tensors=specs)),
              st.lists(tensor_spec(), max_size=4)),
    st.builds(lambda data: pb.UpdateChunk(data=data), st.binary(max_size=64)),
    st.builds(lambda sha: pb.UpdateChunk(trailer=pb.Trailer(sha256=sha)),
              st.one_of(st.text(max_size=64), st.just(hashlib.sha256(b"").hexdigest()))),
    st.just(pb.UpdateChunk()),
)


@st.composite
def mutated_stream(draw: Any) -> list[pb.UpdateChunk]:
    """A valid stream of random tensors, then a few random edits: most examples get deep into the decoder."""
    tensors = draw(arrays())
    header = pb.UpdateHeader(job_id="j", worker_id="w", num_samples=1, tensors=codec.tensor_specs(tensors))
    messages = list(codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes=draw(st.integers(1, 16))))
    for _ in range(draw(st.integers(0, 3))):
        edit = draw(st.sampled_from(["drop", "insert", "swap", "spec", "flip"]))
        if edit == "drop" and messages:
            del messages[draw(st.integers(0, len(messages) - 1))]
        elif edit == "insert":
            messages.insert(draw(st.integers(0, len(messages))), draw(MESSAGE))
        elif edit == "swap" and len(messages) > 1:
            i, j = draw(st.integers(0, len(messages) - 1)), draw(st.integers(0, len(messages) - 1))
            messages[i], messages[j] = messages[j], messages[i]
        elif edit == "spec" and messages and messages[0].WhichOneof("part") == "header" and messages[0].header.tensors:
            edited = copy.deepcopy(messages[0])
            edited.header.tensors[draw(st.integers(0, len(edited.header.tensors) - 1))].CopyFrom(draw(tensor_spec()))
            messages[0] = edited
        elif edit == "flip":
            data = [i for i, m in enumerate(messages) if m.WhichOneof("part") == "data" and m.data]
            if data:
                i = draw(st.sampled_from(data))
                raw = bytearray(messages[i].data)
                raw[draw(st.integers(0, len(raw) - 1))] ^= 1 << draw(st.integers(0, 7))
                messages[i] = pb.UpdateChunk(data=bytes(raw))
    return messages


def _receive(messages: list[pb.UpdateChunk], max_bytes: int) -> None:
    try:
        header, tensors, _digest = codec.receive(iter(messages), max_bytes=max_bytes)
    except UploadRejected as exc:
        assert exc.reason and str(exc)
        return
    assert sum(a.nbytes for a in tensors.values()) <= max_bytes
    assert [t.name for t in header.tensors] == list(tensors)
    for spec in header.tensors:
        assert tensors[spec.name].shape == tuple(spec.shape) and tensors[spec.name].dtype == np.dtype(spec.dtype)


@fuzz(1500)
@given(messages=st.lists(MESSAGE, max_size=8), max_bytes=st.sampled_from([0, 8, 64, 10_000, 1 << 30]))
def test_codec_receive_on_arbitrary_messages_only_rejects(messages, max_bytes):
    _receive(messages, max_bytes)


@fuzz(1200)
@given(messages=mutated_stream(), max_bytes=st.sampled_from([16, 64, 10_000, 1 << 30]))
def test_codec_receive_on_mutated_valid_streams_only_rejects(messages, max_bytes):
    _receive(messages, max_bytes)


def test_an_empty_tensor_with_a_huge_dimension_is_rejected_not_crashed():
    """The fuzzer's first find: numpy cannot even shape it, so it used to escape as ValueError."""
    header = pb.UpdateHeader(tensors=[pb.TensorSpec(name="t", dtype="float32", shape=[0, 2 ** 62, 2 ** 62])])
    messages = [pb.UpdateChunk(header=header), pb.UpdateChunk(trailer=pb.Trailer(sha256=hashlib.sha256(b"").hexdigest()))]
    with pytest.raises(UploadRejected, match="empty but has dimensions") as info:
        codec.receive(iter(messages), max_bytes=1 << 30)
    assert info.value.reason == "wrong_shape"


# ----- parse_job -------------------------------------------------------------------------------------

GOOD = {
    "name": "fuzz", "category": "digits", "seed": 1,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1},
        {"type": "GroupNorm", "num_groups": 2, "num_channels": 4}, {"type": "MaxPool2d", "kernel_size": 2},
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}, {"type": "Dropout"}]},
    "training": {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.1, "optimizer": "adam"},
    "aggregation": {"alignment": "feddna", "weighting": "dwfed", "selection": "ga",
                    "selection_params": {"m": 2, "probe_dataset": "digits", "ga_gap": 2}},
    "schedule": {"clients_per_round": 3, "min_clients": 2},
    "evaluation": {"dataset": "digits"},
}
KEYS = st.one_of(st.sampled_from(sorted({"name", "category", "model", "training", "aggregation", "schedule",
                                         "evaluation", "seed", "input_shape", "layers", "type", "in_features",
                                         "out_features", "kernel_size", "stride", "padding", "rounds", "lr", "m",
                                         "alignment", "weighting", "selection", "selection_params",
                                         "weighting_params", "alignment_params", "__doc__", "__class__"})),
                 st.text(max_size=8))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-3, 70), st.floats(), st.text(max_size=12),
                    st.binary(max_size=4), st.dates(), st.datetimes(),
                    st.sampled_from(["Linear", "Conv2d", "Flatten", "ReLU", "GroupNorm", "sgd", "fedavg", "ga",
                                     "feddna", "pfnm", "nafi", "dwfed", "random", "all", "none", "digits"]))
HASHABLE = st.one_of(KEYS, st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(), st.dates())
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner), st.frozensets(HASHABLE, max_size=3),
                            st.dictionaries(st.one_of(KEYS, HASHABLE), inner, max_size=4)),
    max_leaves=20,
)


@st.composite
def mutated_job(draw: Any) -> Any:
    """The good job with a few subtrees replaced, removed or added: deep paths get exercised."""
    job = copy.deepcopy(GOOD)
    for _ in range(draw(st.integers(1, 4))):
        node: Any = job
        path = []
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node, key=repr) if isinstance(node, dict) else range(len(node))))
            path.append(key)
            parent, node = node, node[key]
        if not path:
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(VALUES)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(HASHABLE)] = draw(VALUES)
        else:
            parent.append(draw(VALUES))
    return job


def _parse(raw: Any) -> None:
    try:
        job = accept_job(raw)  # the parser and the algorithm catalogue, as SubmitJob runs them
    except ConfigError as exc:
        assert str(exc) and len(str(exc)) < 200_000
        return
    assert accept_job(json.loads(job.to_json())) == job  # what is accepted is plain data that round-trips


@fuzz(2000)
@given(raw=VALUES)
def test_parse_job_on_arbitrary_values_only_raises_config_errors(raw):
    _parse(raw)


@fuzz(1500)
@given(raw=mutated_job())
def test_parse_job_on_mutated_good_jobs_only_raises_config_errors(raw):
    _parse(raw)


YAML_BITS = st.sampled_from(["name: j\n", "category: digits\n", "model: ", "{", "}", "[", "]", "- ", ": ", "&a ",
                             "*a ", "!!binary ", "!!python/object:os.system ", "2024-02-30", "2024-01-01 ",
                             "!!set {a, b}", ".nan", "0x1F", "~", "? [a]\n: b\n", "'", '"', "\n", "  ", "|\n", "!!int x"])


@fuzz(800)
@given(text=st.one_of(st.text(max_size=80), st.lists(YAML_BITS, max_size=25).map("".join)))
def test_job_text_in_any_shape_only_raises_config_errors(text):
    try:
        job_from_text(text)
    except ConfigError:
        pass


@pytest.mark.parametrize("raw, field", [
    ({"name": "j", "category": "digits", "model": {}, 7: 1}, "job.7"),
    ({"name": "j", "category": "digits", "model": {}, "training": {"__doc__": "x"}}, "training.__doc__"),
    ({"name": "j", "category": "digits", "model": {}, "seed": datetime.date(2024, 1, 1)}, "job.seed"),
    ({"name": "j", "category": "digits", "model": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
     "job.model"),
])
def test_what_the_fuzzer_found_in_parse_job_is_a_config_error_naming_the_field(raw, field):
    with pytest.raises(ConfigError) as info:
        parse_job(raw)
    assert field in str(info.value), str(info.value)


def test_job_text_with_an_impossible_date_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid YAML"):
        job_from_text("name: j\ncategory: digits\nseed: 2024-02-30\n")
