import json
import os

import numpy as np
import pytest

from fedbroker.errors import ConfigError
from fedbroker.worker.ledger import PrivacyLedger


def test_a_new_ledger_knows_no_jobs(tmp_path):
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"))
    assert ledger.jobs() == {} and ledger.total_epsilon() == 0.0
    assert ledger.history("job") == [] and ledger.epsilon("job") == 0.0
    assert not os.path.exists(tmp_path / "ledger.json")  # nothing written until something is spent


def test_ledger_survives_a_reopen_with_the_same_path(tmp_path):
    path = str(tmp_path / "state" / "ledger.json")
    history = [(1.1, 1 / 45, 90), (1.3, 0.02, np.int64(7))]
    PrivacyLedger(path).record("job-a", history=history, epsilon=1.25)
    reopened = PrivacyLedger(path)
    assert reopened.history("job-a") == [(1.1, 1 / 45, 90), (1.3, 0.02, 7)]
    assert reopened.epsilon("job-a") == 1.25
    assert all(isinstance(e[2], int) for e in reopened.history("job-a"))


def test_total_epsilon_sums_the_jobs(tmp_path):
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"))
    ledger.record("a", history=[(1.0, 0.1, 10)], epsilon=1.5)
    ledger.record("b", history=[(1.0, 0.1, 20)], epsilon=2.25)
    ledger.record("a", history=[(1.0, 0.1, 30)], epsilon=2.0)
    assert ledger.jobs() == {"a": 2.0, "b": 2.25}
    assert ledger.total_epsilon() == pytest.approx(4.25)
    assert PrivacyLedger(ledger.path).total_epsilon() == pytest.approx(4.25)


def test_ledger_file_is_plain_json(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(str(path)).record("job", history=[(1.0, 0.5, 3)], epsilon=0.75)
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc == {"version": 1, "jobs": {"job": {"epsilon": 0.75, "history": [[1.0, 0.5, 3]]}}}
    # no temp files left behind; the mark holds the highest total written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.json", "ledger.json.mark"]
    assert json.loads((tmp_path / "ledger.json.mark").read_text(encoding="utf-8")) == {"total_epsilon": 0.75}


def test_recording_a_lower_epsilon_is_refused_and_changes_nothing(tmp_path):
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"))
    ledger.record("job", history=[(1.0, 0.1, 20)], epsilon=2.0)
    with pytest.raises(ConfigError, match="lower"):
        ledger.record("job", history=[(1.0, 0.1, 10)], epsilon=1.0)
    assert PrivacyLedger(ledger.path).history("job") == [(1.0, 0.1, 20)]


@pytest.mark.parametrize("content", ["{not json", "[]", '{"version": 99, "jobs": {}}', '{"version": 1, "jobs": {"j": {}}}'])
def test_an_unreadable_ledger_raises_instead_of_starting_from_zero(tmp_path, content):
    path = tmp_path / "ledger.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        PrivacyLedger(str(path))
    assert info.value.field == str(path)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"epsilon": float("nan")}, "epsilon"),
        ({"epsilon": -1.0}, "epsilon"),
        ({"history": [(1.0, 0.1)]}, "history[0]"),
        ({"history": [(1.0, 1.5, 3)]}, "history[0]"),
        ({"history": [(1.0, 0.1, 2.5)]}, "history[0]"),
    ],
)
def test_bad_records_name_the_field(tmp_path, kwargs, field):
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"))
    args = {"history": [(1.0, 0.1, 3)], "epsilon": 1.0} | kwargs
    with pytest.raises(ConfigError) as info:
        ledger.record("job", **args)
    assert info.value.field == field


def test_a_ledger_below_its_mark_is_refused_at_load(tmp_path):
    """An older ledger restored over the latest one (or an edit) would hand back spent ε: refused, naming both."""
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(str(path))
    ledger.record("job", history=[(1.0, 0.1, 10)], epsilon=1.0)
    older = path.read_bytes()
    ledger.record("job", history=[(1.0, 0.1, 20)], epsilon=2.0)
    path.write_bytes(older)
    with pytest.raises(ConfigError, match=r"holds ε 1, below the 2 its mark .*ledger.json.mark"):
        PrivacyLedger(str(path))


def test_a_missing_ledger_whose_mark_says_epsilon_was_spent_is_refused_at_load(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(str(path)).record("job", history=[(1.0, 0.1, 10)], epsilon=1.5)
    path.unlink()
    with pytest.raises(ConfigError, match="missing, but its mark .* says ε 1.5 was spent"):
        PrivacyLedger(str(path))
    (tmp_path / "ledger.json.mark").unlink()  # both gone: only the coordinator's record can tell
    assert PrivacyLedger(str(path)).total_epsilon() == 0.0


def test_a_release_is_charged_once_kept_across_restarts_and_a_new_draw_adds_its_epsilon(tmp_path):
    path = str(tmp_path / "ledger.json")
    ledger = PrivacyLedger(path)
    ledger.record("job", history=[(1.0, 0.1, 10)], epsilon=2.0)
    ledger.record_release("label_histogram", value=[3, 0, 5], epsilon=1.0, source=[2, 1, 5])
    assert ledger.total_epsilon() == pytest.approx(3.0)
    again = PrivacyLedger(path)
    kept = again.release("label_histogram")
    assert kept is not None and kept.value == [3, 0, 5] and kept.draw_epsilon == 1.0
    assert again.total_epsilon() == pytest.approx(3.0) and again.jobs() == {"job": 2.0}
    again.record_release("label_histogram", value=[1, 1, 1], epsilon=0.5, source=[1, 1, 1])
    assert PrivacyLedger(path).total_epsilon() == pytest.approx(3.5)  # both draws were published: both count


def test_a_missing_ledger_is_a_warning_except_where_a_run_starts_its_workers_afresh(tmp_path, caplog):
    import logging

    from fedbroker.worker.ledger import fresh_ledgers

    with caplog.at_level(logging.INFO, logger="fedbroker.worker.ledger"):
        PrivacyLedger(str(tmp_path / "real-worker.json"))
        with fresh_ledgers():
            PrivacyLedger(str(tmp_path / "demo-worker.json"))
    levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records if "no privacy ledger" in r.getMessage()}
    assert levels == {f"no privacy ledger at {tmp_path / 'real-worker.json'}": "WARNING",
                      f"no privacy ledger at {tmp_path / 'demo-worker.json'}": "INFO"}


def test_the_shared_log_survives_a_restart_and_charges_nothing(tmp_path):
    path = str(tmp_path / "ledger.json")
    ledger = PrivacyLedger(path, worker_id="site-a")
    ledger.record("job-1", history=[(1.1, 0.01, 10)], epsilon=0.5)
    ledger.note_shared("job-1", "histogram", epsilon=1.0)
    ledger.note_shared("job-1", "evaluation", recipient="coordinator")
    again = PrivacyLedger(path, worker_id="site-a")
    assert [(s.job_id, s.what, s.epsilon) for s in again.shared()] == [("job-1", "histogram", 1.0),
                                                                        ("job-1", "evaluation", 0.0)]
    assert again.total_epsilon() == pytest.approx(0.5)  # the log notes ε charged elsewhere; it adds none


def test_a_malformed_shared_log_is_refused(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(str(path), worker_id="site-a").note_shared("job-1", "histogram")
    doc = json.loads(path.read_text())
    doc["shared"][0].pop("what")
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"shared\[0\]"):
        PrivacyLedger(str(path), worker_id="site-a")
