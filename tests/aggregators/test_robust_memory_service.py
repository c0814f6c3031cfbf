"""The service keeps a robust rule's memory with the job: centered clipping's momentum and the history check's
per-site history carry from round to round, survive a restart on the same spool, and a flagged site is
reported as flagged in the close (and in the coordinator's note)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.app.round_notes import robust_note
from fedbroker.close_report import Verdict
from tests.aggregators.test_rounds import SPEC, stream

SITES = [f"w{i}" for i in range(6)] + ["evil"]
NAMES = {"0.weight": (3, 4), "0.bias": (3,), "2.weight": (2, 3), "2.bias": (2,)}
P = sum(math.prod(s) for s in NAMES.values())


def tensors(vector: np.ndarray) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for name, shape in NAMES.items():
        size = math.prod(shape)
        out[name] = vector[at:at + size].reshape(shape).astype(np.float32)
        at += size
    return out


def flat(state: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([state[name].ravel() for name in NAMES]).astype(np.float64)


def play(book: RoundBook, rounds: range, aggregation: dict[str, Any], *, switch: int = 10**6) -> list[Any]:
    """Rounds of a quadratic federation (Δ_i = −0.1·(w − c_i) + noise); `evil` sends ALIE-like updates from
    round `switch` on. The close results."""
    centres = np.random.default_rng(0).normal(size=(len(SITES), P)) * 3.0
    results = []
    for t in rounds:
        w = flat(book.global_model("j")[2])
        rng = np.random.default_rng(t)
        deltas = np.array([-0.1 * (w - c) + 0.02 * rng.normal(size=P) for c in centres])
        if t >= switch:
            deltas[-1] = deltas[:-1].mean(axis=0) - deltas[:-1].std(axis=0)
        book.open_round("j", t, SITES, deadline=math.inf, aggregation=aggregation, seed=0)
        for site, delta in zip(SITES, deltas):
            book.receive_update(stream(tensors(w + delta), rnd=t, worker=site, n=10))
        results.append(book.close("j", t))
    return results


def new_book(spool: Path | None, *, start: bool) -> RoundBook:
    book = RoundBook(max_update_bytes=10_000, spool_dir=spool)
    if start:
        book.put_global("j", 1, SPEC.to_json(), tensors(np.zeros(P)))
    return book


CC = {"alignment": "none", "weighting": "uniform", "selection": "all", "robust": "centered_clipping",
      "robust_params": {"tau": 0.05}}
HC = {"alignment": "none", "weighting": "uniform", "selection": "all", "robust": "history_check",
      "robust_params": {"inner": "median"}}


def test_centered_clipping_s_momentum_carries_across_rounds_and_a_restart(tmp_path: Path) -> None:
    book = new_book(tmp_path / "a", start=True)
    play(book, range(1, 3), CC)
    memory = book.table.job("j").robust_memory
    assert memory is not None and memory.closes == 2 and memory.previous is not None
    last = flat(book.global_model("j")[2])
    folder = book.table.spool.folder("j") if book.table.spool is not None else tmp_path
    # one memory file per kept global version (the older ones pruned with their versions)
    assert sorted(p.name for p in folder.glob("robust-*.npz")) == ["robust-3.npz"]
    book.stop()
    restarted = new_book(tmp_path / "a", start=False)
    kept = restarted.table.job("j").robust_memory
    assert kept is not None and kept.closes == 2
    np.testing.assert_array_equal(kept.previous, memory.previous)
    (after_restart,) = play(restarted, range(3, 4), CC)
    restarted.stop()
    uninterrupted = new_book(None, start=True)
    play(uninterrupted, range(1, 4), CC)
    np.testing.assert_array_equal(flat(restarted.global_model("j")[2]), flat(uninterrupted.global_model("j")[2]))
    assert after_restart.stats["robust_cc_momentum"] == 1.0
    # each round moves the model at most τ from the last aggregate: momentum, not a restart from zero
    step = flat(restarted.global_model("j")[2]) - last
    assert np.linalg.norm(step - memory.previous) <= 0.05 + 1e-5


def test_a_site_that_turns_is_reported_flagged_and_stays_flagged_after_a_restart(tmp_path: Path) -> None:
    book = new_book(tmp_path / "b", start=True)
    results = play(book, range(1, 7), HC, switch=5)
    judged = {v.worker_id: v.judgement for v in results[4].verdicts}
    assert judged["evil"] == "flagged" and all(judged[s] != "flagged" for s in SITES[:-1])
    assert results[4].stats["robust_history_flagged"] == 1.0 and "evil" not in results[4].aggregated
    assert "flagged evil" in robust_note(results[4].verdicts)
    wire = next(v for v in results[4].verdicts if v.worker_id == "evil").to_proto()
    assert wire.discarded and wire.reason == "flagged" and Verdict.from_proto(wire).flagged
    assert all("flagged" not in {v.judgement for v in r.verdicts} for r in results[:4])
    book.stop()
    restarted = new_book(tmp_path / "b", start=False)
    (later,) = play(restarted, range(7, 8), HC)   # honest again: still excluded, its history kept
    assert {v.worker_id: v.judgement for v in later.verdicts}["evil"] == "flagged"
    memory = restarted.table.job("j").robust_memory
    assert memory is not None and memory.flagged == {"evil"} and len(memory.sites["w0"].scores) >= 5
    restarted.stop()


def test_a_new_model_installed_drops_the_memory() -> None:
    book = new_book(None, start=True)
    play(book, range(1, 3), CC)
    assert book.table.job("j").robust_memory is not None
    book.put_global("j", 10, SPEC.to_json(), tensors(np.ones(P)))
    assert book.table.job("j").robust_memory is None


def test_a_damaged_memory_file_quarantines_its_job_instead_of_forgetting_who_was_flagged(tmp_path: Path) -> None:
    book = new_book(tmp_path / "c", start=True)
    play(book, range(1, 3), CC)
    assert book.table.spool is not None
    path = book.table.spool.folder("j") / "robust-3.npz"
    # centered clipping keeps the aggregate only: no site's own update is written beside it
    with np.load(path, allow_pickle=False) as kept:
        assert not [name for name in kept.files if name.startswith("site-")]
    book.stop()
    path.write_bytes(b"not an npz")
    restarted = new_book(tmp_path / "c", start=False)
    assert "j" not in restarted.table.jobs      # the coordinator re-installs the model: a fresh memory, said so
    assert any((tmp_path / "c" / "quarantine").iterdir())
    restarted.stop()


def test_a_close_that_fails_leaves_the_memory_as_it_was(tmp_path: Path, monkeypatch: Any) -> None:
    book = new_book(tmp_path / "d", start=True)
    play(book, range(1, 3), HC)
    before = book.table.job("j").robust_memory
    assert book.table.spool is not None

    def full_disk(*_: Any, **__: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(book.table.spool, "save_global", full_disk)
    with pytest.raises(OSError, match="No space"):  # the close fails: the round stays open
        play(book, range(3, 4), HC)
    assert book.table.job("j").robust_memory is before
    monkeypatch.undo()
    retried = book.close("j", 3)
    memory = book.table.job("j").robust_memory
    assert memory is not None and before is not None and memory.closes == before.closes + 1
    assert retried.model_version == 4
    book.stop()
