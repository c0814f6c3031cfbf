"""DownloadGlobalModel hashes a global version once and never serves a digest that does not fit its bytes."""

from __future__ import annotations

import gc
import hashlib
import json
import threading
import weakref

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import AggregationServicer, DigestCache
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec

WIDTH = 6
SPEC = json.dumps({"input_shape": [WIDTH], "layers": [{"type": "Linear", "in_features": WIDTH, "out_features": WIDTH}]})


def model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"0.weight": rng.standard_normal((WIDTH, WIDTH), dtype=np.float32),
            "0.bias": rng.standard_normal(WIDTH, dtype=np.float32)}


def sha256_of(tensors: dict[str, np.ndarray]) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a, "<f4").tobytes() for a in tensors.values())).hexdigest()


@pytest.fixture
def hashes(monkeypatch):
    """Counts the global-model hashes the service starts; `gate` holds them until it is set."""
    started: list[int] = []
    gate = threading.Event()
    gate.set()
    real = codec.tensors_sha256

    def counting(tensors):
        started.append(1)
        gate.wait(10)
        return real(tensors)

    monkeypatch.setattr(codec, "tensors_sha256", counting)
    counting.started, counting.gate = started, gate
    return counting


def request(servicer: AggregationServicer, version: int = 0):
    return servicer.DownloadGlobalModel(pb.GlobalModelRequest(job_id="j", version=version), None)


def received(raw: list[bytes]) -> tuple[str, dict[str, np.ndarray]]:
    """What a client makes of the handler's serialized messages (receive checks the trailer's digest)."""
    _, tensors, digest = codec.receive(codec.decoded_stream(raw, pb.ModelChunk), max_bytes=1 << 20)
    return digest, tensors


def download(servicer: AggregationServicer, version: int = 0) -> tuple[str, dict[str, np.ndarray]]:
    return received(list(request(servicer, version)))


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name, arr in want.items():
        np.testing.assert_array_equal(got[name], arr)


def wait_for_hashes() -> None:
    for thread in threading.enumerate():
        if thread.name == "sha256-global":
            thread.join()


def test_repeated_downloads_hash_a_version_once_and_send_the_same_bytes(hashes):
    book = RoundBook()
    book.put_global("j", 1, SPEC, model(1))
    servicer = AggregationServicer(book)
    first, second = list(request(servicer)), list(request(servicer))
    assert second == first
    digest, tensors = received(first)
    assert digest == sha256_of(model(1)) and len(hashes.started) == 1
    assert_same(tensors, model(1))


def test_downloads_that_start_together_share_one_hash(hashes):
    book = RoundBook()
    book.put_global("j", 1, SPEC, model(1))
    servicer = AggregationServicer(book)
    hashes.gate.clear()  # the hash is still running when both streams have started
    streams = [request(servicer) for _ in range(3)]
    heads = [next(s) for s in streams]
    hashes.gate.set()
    for head, stream in zip(heads, streams):
        assert received([head, *stream])[0] == sha256_of(model(1))
    assert len(hashes.started) == 1


def test_a_version_installed_again_with_other_weights_is_hashed_afresh(hashes):
    book = RoundBook()
    book.put_global("j", 1, SPEC, model(1))
    servicer = AggregationServicer(book)
    assert download(servicer)[0] == sha256_of(model(1))
    book.put_global("j", 1, SPEC, model(2))  # same job and version, other weights (a restarted coordinator)
    digest, tensors = download(servicer)
    assert digest == sha256_of(model(2)) and len(hashes.started) == 2
    assert_same(tensors, model(2))


def test_a_restarted_book_with_other_weights_under_the_same_version_is_not_served_stale(tmp_path):
    book = RoundBook(spool_dir=tmp_path)
    book.put_global("j", 1, SPEC, model(1))
    servicer = AggregationServicer(book)
    assert download(servicer)[0] == sha256_of(model(1))
    book.stop()
    other = RoundBook(spool_dir=tmp_path)
    other.put_global("j", 1, SPEC, model(2))  # written to the spool by another book
    other.stop()
    servicer.book = RoundBook(spool_dir=tmp_path)  # the restart, with the old servicer's cache kept on purpose
    digest, tensors = download(servicer)
    assert digest == sha256_of(model(2))
    assert_same(tensors, model(2))


def test_each_kept_version_has_its_own_digest():
    book = RoundBook()
    book.put_global("j", 1, SPEC, model(1))
    servicer = AggregationServicer(book)
    book.open_round("j", 1, ["w1"], deadline=2e9, aggregation={}, seed=0)
    update = model(3)
    header = pb.UpdateHeader(job_id="j", round=1, worker_id="w1", num_samples=1, tensors=codec.tensor_specs(update))
    book.receive_update(codec.stream_messages(pb.UpdateChunk, header, update))
    book.close("j", 1)
    for _ in range(2):
        assert download(servicer, 1)[0] == sha256_of(model(1))
        assert download(servicer, 2)[0] == sha256_of(book.global_model("j", 2)[2])


def test_the_cache_holds_a_digest_only_for_the_very_arrays_it_hashed():
    cache = DigestCache()
    tensors = model(1)
    known = cache.digest(("j", 1), tensors)
    assert known.result(10) == sha256_of(tensors)
    assert cache.digest(("j", 1), dict(tensors)) is known  # another dict, the same arrays
    assert cache.digest(("j", 1), model(1)) is not known  # equal values, other arrays
    known = cache.digest(("j", 1), tensors)
    assert cache.digest(("j", 2), tensors) is not known
    assert cache.digest(("j", 1), {"0.weight": tensors["0.weight"]}) is not known
    known = cache.digest(("j", 1), tensors)
    del tensors
    wait_for_hashes()
    gc.collect()
    assert cache.digest(("j", 1), model(1)) is not known  # freed arrays: a new one at the same address cannot match


def test_a_failed_hash_is_not_kept(monkeypatch):
    cache = DigestCache()
    tensors = model(1)
    monkeypatch.setattr(codec, "tensors_sha256", lambda _: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cache.digest(("j", 1), tensors).result(10)
    monkeypatch.undo()
    assert cache.digest(("j", 1), tensors).result(10) == sha256_of(tensors)


def test_the_cache_keeps_no_model_alive_and_forgets_the_oldest_entries():
    cache = DigestCache(max_entries=2)
    kept = {v: model(v) for v in range(3)}
    futures = {v: cache.digest(("j", v), tensors) for v, tensors in kept.items()}
    assert cache.digest(("j", 0), kept[0]) is not futures[0]  # evicted: hashed again
    assert cache.digest(("j", 2), kept[2]) is futures[2]
    probe = model(9)
    watch = weakref.ref(probe["0.weight"])
    cache.digest(("k", 1), probe).result(10)
    del probe
    wait_for_hashes()
    gc.collect()
    assert watch() is None
