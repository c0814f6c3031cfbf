"""A cancelled job's round at the aggregation service: dropped, never aggregated, and it stays dropped."""

from __future__ import annotations

import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.errors import Conflict, NotFound, UploadRejected
from fedbroker.proto import fedbroker_pb2 as pb
from tests.aggregators.test_rounds import AGG, SPEC, stream, weights


def opened(**kwargs) -> RoundBook:
    book = RoundBook(max_update_bytes=10_000, clock=lambda: 1000.0, **kwargs)
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_round("j", 1, ["w1", "w2"], deadline=2000.0, aggregation=AGG, seed=0)
    return book


def test_an_abandoned_round_makes_no_version_and_refuses_later_uploads():
    book = opened()
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    dropped = book.abandon("j", 1)
    assert [(u.worker_id, u.num_samples) for u in dropped] == [("w1", 10)]
    version, _, state = book.global_model("j")
    assert version == 1 and float(state["0.weight"].max()) == 0.0  # the global model is untouched
    with pytest.raises(UploadRejected) as refused:
        book.receive_update(stream(weights(2.0), worker="w2", n=10))
    assert refused.value.reason == "round_closed"
    with pytest.raises(NotFound, match="not open"):
        book.close("j", 1)
    with pytest.raises(Conflict):  # nor can it be opened again and filled
        book.open_round("j", 1, ["w1", "w2"], deadline=2000.0, aggregation=AGG, seed=0)


def test_abandon_is_idempotent_and_never_undoes_a_close():
    book = opened()
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    assert len(book.abandon("j", 1)) == 1
    assert book.abandon("j", 1) == []  # a retry after a lost reply
    closed = opened()
    closed.receive_update(stream(weights(1.0), worker="w1", n=10))
    closed.close("j", 1)
    with pytest.raises(Conflict, match="already closed"):
        closed.abandon("j", 1)


def test_an_abandoned_round_stays_abandoned_after_a_restart_from_the_spool(tmp_path):
    book = opened(spool_dir=tmp_path)
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    book.abandon("j", 1)
    assert not any(p.name.startswith("round-") for p in (tmp_path).rglob("*") if p.is_dir())  # uploads deleted
    book.stop()
    again = RoundBook(max_update_bytes=10_000, clock=lambda: 1000.0, spool_dir=tmp_path)
    assert again.global_model("j")[0] == 1
    # closed, and the discarded upload's worker is told it was accepted: a redelivered task trains nothing again
    assert again.status("j", 1) == (["w1"], False)
    with pytest.raises(UploadRejected):
        again.receive_update(stream(weights(2.0), worker="w2", n=10))


def test_the_proto_carries_the_discarded_uploads():
    reply = pb.AbandonRoundReply(discarded=[pb.UpdateSummary(worker_id="w1", num_samples=3, epsilon=0.5)])
    assert pb.AbandonRoundReply.FromString(reply.SerializeToString()).discarded[0].epsilon == 0.5
