"""The aggregation service with a job that trains a subset (model.freeze, LoRA adapters): it admits and
averages only the trainable tensors, keeps the frozen ones as they started, and refuses an upload carrying a
frozen tensor or an adapter of another rank, naming it."""

from __future__ import annotations

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.errors import Rejection, UploadRejected
from fedbroker.job.settings import settings_message
from fedbroker.job.spec import parse_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.weights.adapters import start_state
from fedbroker.weights.plan import trainable_names

MODEL = {"input_shape": [4], "layers": [
    {"type": "Linear", "in_features": 4, "out_features": 3}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 3, "out_features": 2}]}


def stream(tensors, *, worker="w1", n=10):
    header = pb.UpdateHeader(job_id="j", round=1, worker_id=worker, num_samples=n,
                             tensors=codec.tensor_specs(tensors))
    return codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes=64)


def book_for(**plan: object) -> tuple[RoundBook, dict[str, np.ndarray], list[str]]:
    job = parse_job({"name": "j", "category": "c", "model": {**MODEL, **plan}})
    book = RoundBook(max_update_bytes=10_000)
    book.installed.install(settings_message("j", job))
    start = start_state(job.model, job.plan, seed=0)
    book.put_global("j", 1, job.model.to_json(), start)
    book.open_round("j", 1, ["w1", "w2"], deadline=4e9, seed=0)
    return book, start, trainable_names(job.model, job.plan)


def test_frozen_tensors_stay_as_they_started_and_the_rest_is_averaged() -> None:
    book, start, trains = book_for(freeze=["0"])
    assert trains == ["2.weight", "2.bias"]
    book.receive_update(stream({n: np.full_like(start[n], 1.0) for n in trains}, worker="w1", n=10))
    book.receive_update(stream({n: np.full_like(start[n], 4.0) for n in trains}, worker="w2", n=30))
    book.close("j", 1)
    _, _, state = book.global_model("j")
    assert list(state) == list(start)
    np.testing.assert_array_equal(state["0.weight"], start["0.weight"])
    np.testing.assert_array_equal(state["0.bias"], start["0.bias"])
    np.testing.assert_allclose(state["2.weight"], 3.25)


def test_an_upload_carrying_a_frozen_tensor_is_refused_naming_it() -> None:
    book, start, trains = book_for(freeze=["0"])
    with pytest.raises(UploadRejected, match=r"'0\.weight' does not train.*node '0' is frozen") as info:
        book.receive_update(stream({**{n: start[n] for n in trains}, "0.weight": start["0.weight"]}))
    assert info.value.reason == Rejection.UNKNOWN_TENSOR


def test_lora_uploads_carry_adapters_and_heads_only_and_a_wrong_rank_is_refused() -> None:
    book, start, trains = book_for(adapters={"rank": 2, "targets": ["0"], "train": ["2"]})
    assert trains == ["2.weight", "2.bias", "0.lora_a.weight", "0.lora_b.weight"]
    with pytest.raises(UploadRejected, match="'0.weight' does not train"):
        book.receive_update(stream({**{n: start[n] for n in trains}, "0.weight": start["0.weight"]}))
    wrong = {**{n: start[n] for n in trains}, "0.lora_a.weight": np.zeros((3, 4), np.float32)}
    with pytest.raises(UploadRejected, match=r"'0\.lora_a\.weight' has shape \[3, 4\], expected \[2, 4\]") as info:
        book.receive_update(stream(wrong))
    assert info.value.reason == Rejection.WRONG_SHAPE
    book.receive_update(stream({n: start[n] + 1 for n in trains}))
    book.close("j", 1)
    _, _, state = book.global_model("j")
    np.testing.assert_array_equal(state["0.weight"], start["0.weight"])   # the adapted base never moves
    np.testing.assert_allclose(state["0.lora_b.weight"], 1.0)


def test_a_global_model_without_its_adapters_is_refused() -> None:
    job = parse_job({"name": "j", "category": "c", "model": {**MODEL, "adapters": {"rank": 2, "targets": ["0"]}}})
    book = RoundBook(max_update_bytes=10_000)
    book.installed.install(settings_message("j", job))
    plain = {k: v for k, v in start_state(job.model, job.plan, seed=0).items() if ".lora_" not in k}
    with pytest.raises(UploadRejected, match="lora_a.weight' is missing"):
        book.put_global("j", 1, job.model.to_json(), plain)


def test_a_restarted_service_restores_an_adapter_job_and_its_subset_update_from_the_spool(tmp_path) -> None:
    job = parse_job({"name": "j", "category": "c", "model": {**MODEL, "adapters": {"rank": 2, "targets": ["0"],
                                                                                    "train": ["2"]}}})
    book = RoundBook(max_update_bytes=10_000, spool_dir=tmp_path)
    book.installed.install(settings_message("j", job))
    start = start_state(job.model, job.plan, seed=0)
    book.put_global("j", 1, job.model.to_json(), start)
    book.open_round("j", 1, ["w1", "w2"], deadline=4e9, seed=0)
    trains = trainable_names(job.model, job.plan)
    book.receive_update(stream({n: start[n] + 1 for n in trains}))
    book.stop()
    again = RoundBook(max_update_bytes=10_000, spool_dir=tmp_path)
    try:
        assert again.status("j", 1)[0] == ["w1"]          # the update came back, not quarantined
        again.close("j", 1)
        _, _, state = again.global_model("j")
        np.testing.assert_array_equal(state["0.weight"], start["0.weight"])
        np.testing.assert_allclose(state["0.lora_a.weight"], start["0.lora_a.weight"] + 1, rtol=1e-6)
    finally:
        again.stop()
