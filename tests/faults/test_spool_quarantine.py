"""A damaged spool record never stops the aggregation service: at start, a job folder or an update file that
does not load is moved to the spool's quarantine/ folder (a log line, a metric) and everything else is
restored and served."""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.spool import QUARANTINE_DIR, Spool, job_folder
from fedbroker.errors import NotFound
from tests.aggregators.test_rounds import SPEC, stream, weights
from tests.faults.harness import Federation, Training, job, wait_for

pytestmark = [pytest.mark.integration]

FEDAVG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}
WORKERS = ["w1", "w2", "w3"]


def quarantined(kind: str) -> float:
    return REGISTRY.get_sample_value("fedbroker_aggregator_spool_quarantined_total", {"kind": kind}) or 0.0


def two_jobs(spool: Path) -> RoundBook:
    """`done`: a finished job (its round closed); `j`: a job with an open round and two accepted uploads."""
    book = RoundBook(spool_dir=spool)
    for job_id in ("done", "j"):
        book.put_global(job_id, 1, SPEC.to_json(), weights(0.0))
        book.open_round(job_id, 1, WORKERS, deadline=4e9, aggregation=FEDAVG, seed=5)
    book.receive_update(stream(weights(3.0), worker="w1", n=10, job="done"))
    book.close("done", 1)
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    book.receive_update(stream(weights(4.0), worker="w2", n=30))
    book.stop()  # the service stops; its spool remains
    return book


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def globals_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("global-*.npz"))


def another_shape(folder: Path) -> None:
    spool = Spool(folder.parent)
    spool.save_global("done", int(globals_of(folder)[-1].stem.split("-")[1]), SPEC.to_json(),
                      {"0.weight": np.zeros((9, 9), np.float32)})
    spool.close()


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "truncated-job-json": lambda folder: truncate(folder / "job.json"),
    "job-json-of-another-format": lambda folder: (folder / "job.json").write_text('{"format": 99}'),
    "job-json-missing-fields": lambda folder: (folder / "job.json").write_text(
        (folder / "job.json").read_text().replace('"closed_rounds"', '"renamed"')),
    "truncated-global-model": lambda folder: truncate(globals_of(folder)[-1]),
    "global-model-of-another-shape": another_shape,
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("corrupt", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_a_job_whose_record_does_not_load_is_quarantined_and_every_other_job_is_restored(
        tmp_path: Path, corrupt: str, caplog: pytest.LogCaptureFixture) -> None:
    two_jobs(tmp_path)
    folder = job_folder(tmp_path, "done")
    CORRUPTIONS[corrupt](folder)
    before = quarantined("job")

    with caplog.at_level(logging.ERROR, logger="fedbroker.aggregators.spool"):
        restarted = RoundBook(spool_dir=tmp_path)   # starts: the damaged job does not stop it

    assert restarted.status("j", 1) == (["w1", "w2"], True)   # the healthy job, with what it acknowledged
    result = restarted.close("j", 1)
    assert result.aggregated == ["w1", "w2"] and result.model_version == 2
    with pytest.raises(NotFound):
        restarted.global_model("done")   # unknown: a coordinator that still needs it installs it again
    assert not folder.exists()
    moved = list((tmp_path / QUARANTINE_DIR).iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(folder.name) and (moved[0] / "job.json").exists()
    assert quarantined("job") == before + 1
    assert f"{folder} does not load" in caplog.text and "moved to" in caplog.text
    restarted.stop()
    assert RoundBook(spool_dir=tmp_path).global_model("j")[0] == 2   # and the next start is clean


@pytest.mark.timeout(30)
def test_a_damaged_update_file_is_quarantined_and_its_round_goes_on_with_the_other_updates(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    two_jobs(tmp_path)
    files = sorted((job_folder(tmp_path, "j") / "round-1").glob("*.npz"))
    assert len(files) == 2
    truncate(files[0])   # w1's update, accepted first
    before = quarantined("update")

    with caplog.at_level(logging.ERROR, logger="fedbroker.aggregators.spool"):
        restarted = RoundBook(spool_dir=tmp_path)

    assert restarted.status("j", 1) == (["w2"], True)
    assert quarantined("update") == before + 1
    assert "its job is restored without that update" in caplog.text
    with zipfile.ZipFile(files[1]):   # the other update is untouched
        pass
    moved = [p.name for p in (tmp_path / QUARANTINE_DIR).iterdir()]
    assert len(moved) == 1 and moved[0].startswith(f"{files[0].parent.parent.name}.round-1.{files[0].name}.")
    # the lost update's worker is still a participant: its retry is accepted, and the round closes with both
    assert not restarted.receive_update(stream(weights(1.0), worker="w1", n=10)).duplicate
    assert restarted.close("j", 1).aggregated == ["w1", "w2"]


@pytest.mark.timeout(120)
def test_service_restarts_past_a_truncated_record_of_a_finished_job_and_the_running_job_completes(
        federation: Federation, training: Training) -> None:
    fed = federation
    fed.add_worker("fast", index=0, count=2)
    fed.add_worker("slow", index=1, count=2)
    finished = fed.submit(job(name="finished", training={"rounds": 1}))
    fed.wait_job(finished, 60)
    training.step_delay["slow"] = 0.08
    running = fed.submit(job(name="running", training={"rounds": 2}))
    wait_for(lambda: fed.store.round(running, 1) is not None and fed.book.status(running, 1)[0] == ["fast"], 30,
             "the fast worker's round-1 update of the running job")
    fed.stop_aggregator()
    assert fed.spool_dir is not None
    truncate(job_folder(fed.spool_dir, finished) / "job.json")
    fed.start_aggregator(spool=True)   # on old code: JSONDecodeError, the service never comes back
    training.step_delay.clear()
    fed.wait_job(running, 60)
    assert [r.aggregated for r in fed.store.rounds(running)] == [2, 2]
    assert training.count["fast"] == 3   # finished: 1 round; running: 2 rounds, none trained twice
    assert len(list((fed.spool_dir / QUARANTINE_DIR).iterdir())) == 1
