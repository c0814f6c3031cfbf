"""`fedbroker backup` / `restore`: consistent copies of live state, and restores that check before they write.

The coordinator's SQLite file is copied through SQLite's backup API while a thread keeps writing to it; the
spool while its service commits a new round; a ledger never goes back to less ε. Interleavings are made by
construction (a hook inside the copy) or checked by invariants that any torn copy would break, never by timing.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from fedbroker.aggregators import spool_backup
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.app.backup import backup, restore
from fedbroker.app.cli import main
from fedbroker.backup import BackupRefused
from fedbroker.coordinator.checkpoints import load_checkpoint, save_checkpoint
from fedbroker.coordinator.schema import SchemaTooNew
from fedbroker.coordinator.state_dir import StateDirInUse
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_schema import SCHEMA
from fedbroker.worker.ledger import PrivacyLedger
from tests.aggregators.test_rounds import AGG, SPEC, stream, weights

pytestmark = [pytest.mark.timeout(120)]
TENSORS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}


class Writer(threading.Thread):
    """Jobs written one after another until stopped, each a job, its closed round 1 (with a checkpoint), two
    participants and events, every job in two transactions: what a torn copy would show half of."""

    def __init__(self, state: Path, store: StateStore) -> None:
        super().__init__(daemon=True)
        self.state, self.store = state, store
        self.stop = threading.Event()
        self.written = 0
        self.progress = threading.Condition()

    def run(self) -> None:
        while not self.stop.is_set():
            job_id = f"j-{self.written:05d}"
            self.store.add_job(job_id, "n", "{}", 2, "{}")
            self.store.open_round(job_id, 1, ["w0", "w1"])
            path = save_checkpoint(self.state / "checkpoints", job_id, 1, TENSORS, "{}")
            self.store.close_round(job_id, 1, model_version=2, aggregated=["w0"], updates=[("w0", 5, 0.0, 0.1)],
                                   accuracy=None, loss=None, seconds=0.1, checkpoint=path, stats={},
                                   model_spec_json="{}")
            with self.progress:
                self.written += 1
                self.progress.notify_all()

    def wait_for(self, n: int) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: self.written >= n, timeout=60), f"{n} jobs never written"


def check_consistent(state: Path) -> int:
    """The restored file passes SQLite's integrity check and every job is whole; its number of jobs."""
    db = sqlite3.connect(state / "coordinator.sqlite")
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        jobs = [r[0] for r in db.execute("SELECT job_id FROM jobs")]
        for job_id in jobs:
            kinds = sorted(r[0] for r in db.execute("SELECT kind FROM events WHERE job_id = ?", (job_id,)))
            rounds = db.execute("SELECT status, checkpoint FROM rounds WHERE job_id = ?", (job_id,)).fetchall()
            participants = db.execute("SELECT COUNT(*) FROM participants WHERE job_id = ?", (job_id,)).fetchone()[0]
            assert participants in (0, 2)
            if kinds == ["submitted"]:
                assert rounds == []
            elif kinds == ["round_opened", "submitted"]:
                assert rounds == [("open", None)]
            else:
                assert kinds == ["round_closed", "round_opened", "submitted"], kinds
                ((status, checkpoint),) = rounds
                assert status == "closed" and checkpoint.startswith(str(state / "checkpoints"))
                np.testing.assert_array_equal(load_checkpoint(checkpoint)[0]["w"], TENSORS["w"])
        return len(jobs)
    finally:
        db.close()


def test_a_backup_taken_while_a_thread_writes_restores_a_consistent_state(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = StateStore.in_directory(str(state))
    writer = Writer(state, store)
    writer.start()
    try:
        counts = []
        for i in range(3):
            writer.wait_for(5 * (i + 1))  # writes before and between the backups
            before = writer.written
            backup({"coordinator": str(state)}, str(tmp_path / f"b{i}"))
            after = writer.written
            restore(str(tmp_path / f"b{i}"), {"coordinator": str(tmp_path / f"r{i}")})
            counts.append(n := check_consistent(tmp_path / f"r{i}"))
            assert before <= n <= after + 1  # the snapshot of a moment during the backup (a job may be half in)
    finally:
        writer.stop.set()
        writer.join(30)
        store.close()
    assert counts == sorted(counts) and writer.written > counts[0]
    restored = StateStore.in_directory(str(tmp_path / "r2"))  # opens (WAL again) at the latest schema
    try:
        assert restored.schema_version() == SCHEMA.latest and len(restored.jobs()) == counts[2]
    finally:
        restored.close()


def live_state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    store = StateStore.in_directory(str(state))
    store.add_job("j-1", "n", "{}", 2, "{}")
    store.close()
    return state


def test_a_restore_refuses_a_backup_whose_file_does_not_match_its_digest(tmp_path: Path) -> None:
    backup({"coordinator": str(live_state(tmp_path))}, str(tmp_path / "b"))
    db = tmp_path / "b" / "coordinator" / "coordinator.sqlite"
    damaged = bytearray(db.read_bytes())
    damaged[-100] ^= 0xFF
    db.write_bytes(bytes(damaged))
    with pytest.raises(BackupRefused, match=r"coordinator/coordinator.sqlite does not match its digest"):
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})
    assert not (tmp_path / "target").exists()  # checked before anything was written


def test_a_restore_refuses_a_backup_of_a_newer_schema_naming_both_versions(tmp_path: Path) -> None:
    backup({"coordinator": str(live_state(tmp_path))}, str(tmp_path / "b"))
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["parts"]["coordinator"]["version"] = SCHEMA.latest + 1
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BackupRefused, match=rf"at schema version {SCHEMA.latest + 1}, newer than the {SCHEMA.latest}"):
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})
    assert not (tmp_path / "target").exists()


def test_the_coordinator_part_alone_refuses_a_newer_schema_too(tmp_path: Path) -> None:
    from fedbroker.backup import read_manifest
    from fedbroker.coordinator.state_backup import restore_state

    backup({"coordinator": str(live_state(tmp_path))}, str(tmp_path / "b"))
    part = read_manifest(tmp_path / "b")["coordinator"]
    part.version = SCHEMA.latest + 3
    with pytest.raises(SchemaTooNew, match=rf"version {SCHEMA.latest + 3}, newer than the {SCHEMA.latest}"):
        restore_state(tmp_path / "b", part, tmp_path / "target", force=False)


def test_a_restore_refuses_a_target_holding_state_unless_forced_and_one_a_coordinator_holds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = live_state(tmp_path)
    assert main(["backup", "--state", str(state), "--out", str(tmp_path / "b.tar.gz")]) == 0
    other = StateStore.in_directory(str(tmp_path / "target"))
    other.add_job("j-other", "n", "{}", 2, "{}")
    with pytest.raises(StateDirInUse):  # the target's coordinator runs
        restore(str(tmp_path / "b.tar.gz"), {"coordinator": str(tmp_path / "target")}, force=True)
    other.close()
    capsys.readouterr()
    assert main(["restore", str(tmp_path / "b.tar.gz"), "--state", str(tmp_path / "target")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedbroker restore: state: ") and "is not empty" in err and "--force" in err
    kept = StateStore.in_directory(str(tmp_path / "target"))
    assert [j.job_id for j in kept.jobs()] == ["j-other"]  # refused: untouched
    kept.close()
    assert main(["restore", str(tmp_path / "b.tar.gz"), "--state", str(tmp_path / "target"), "--force"]) == 0
    restored = StateStore.in_directory(str(tmp_path / "target"))
    assert [j.job_id for j in restored.jobs()] == ["j-1"]
    restored.close()


# ----- the spool -------------------------------------------------------------------------------------


def spool_with_an_open_round(spool: Path) -> RoundBook:
    book = RoundBook(max_update_bytes=10_000, spool_dir=spool)
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_round("j", 1, ["w1", "w2"], deadline=4e9, aggregation=AGG, seed=0)
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    return book


def test_a_spool_backed_up_while_its_service_runs_restores_the_open_round_with_its_update(tmp_path: Path) -> None:
    book = spool_with_an_open_round(tmp_path / "spool")
    try:
        (part,) = backup({"spool": str(tmp_path / "spool")}, str(tmp_path / "b"))
    finally:
        book.stop()
    assert part.details == {"jobs": 1, "updates": 1}
    restore(str(tmp_path / "b"), {"spool": str(tmp_path / "restored")})
    restarted = RoundBook(spool_dir=tmp_path / "restored")
    try:
        assert restarted.status("j", 1) == (["w1"], True)
        restarted.receive_update(stream(weights(3.0), worker="w2", n=30))
        restarted.close("j", 1)
        np.testing.assert_allclose(restarted.global_model("j")[2]["0.weight"], (10 * 1.0 + 30 * 3.0) / 40)
    finally:
        restarted.stop()


def test_a_spool_job_that_moves_on_during_its_copy_is_copied_again_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    book = spool_with_an_open_round(tmp_path / "spool")
    real = spool_backup.copy_file
    moved = []

    def copy_then_close_the_round(source, target):  # the first file copied: the round closes under the copy
        if not moved:
            moved.append(True)
            book.receive_update(stream(weights(3.0), worker="w2", n=30))
            book.close("j", 1)  # a new record (version 2) that no longer names round 1's folder, which is pruned
        return real(source, target)

    monkeypatch.setattr(spool_backup, "copy_file", copy_then_close_the_round)
    try:
        backup({"spool": str(tmp_path / "spool")}, str(tmp_path / "b"))
        expected = book.global_model("j")
    finally:
        book.stop()
    assert moved
    restore(str(tmp_path / "b"), {"spool": str(tmp_path / "restored")})
    restarted = RoundBook(spool_dir=tmp_path / "restored")
    try:
        version, _, tensors = restarted.global_model("j")
        assert version == expected[0] == 2 and restarted.status("j", 1) == (["w1", "w2"], False)
        for name, array in expected[2].items():
            np.testing.assert_array_equal(tensors[name], array)
    finally:
        restarted.stop()


def test_a_spool_is_not_restored_under_a_running_service(tmp_path: Path) -> None:
    book = spool_with_an_open_round(tmp_path / "spool")
    try:
        backup({"spool": str(tmp_path / "spool")}, str(tmp_path / "b"))
        with pytest.raises(Exception, match="in use by an aggregation service"):
            restore(str(tmp_path / "b"), {"spool": str(tmp_path / "spool")}, force=True)
    finally:
        book.stop()


# ----- a site's ledger --------------------------------------------------------------------------------


def ledger_with(path: Path, epsilon: float) -> None:
    ledger = PrivacyLedger(str(path), worker_id="w0")
    ledger.record("job-a", history=[(1.1, 0.01, 100)], epsilon=epsilon)


def test_a_ledger_round_trip_keeps_its_epsilon_and_never_restores_below_what_was_spent(tmp_path: Path) -> None:
    ledger_with(tmp_path / "ledger.json", 0.5)
    (part,) = backup({"ledger": str(tmp_path / "ledger.json")}, str(tmp_path / "b"))
    assert part.details == {"worker_id": "w0", "total_epsilon": 0.5, "jobs": 1}
    restore(str(tmp_path / "b"), {"ledger": str(tmp_path / "new" / "ledger.json")})
    assert PrivacyLedger(str(tmp_path / "new" / "ledger.json"), worker_id="w0").epsilon("job-a") == 0.5

    ledger_with(tmp_path / "ledger.json", 0.9)  # spent more after the backup
    with pytest.raises(BackupRefused, match=r"holds ε 0.5, below the 0.9 .*--force does not override this"):
        restore(str(tmp_path / "b"), {"ledger": str(tmp_path / "ledger.json")}, force=True)
    (tmp_path / "ledger.json").unlink()  # the ledger lost: its mark still says 0.9
    with pytest.raises(BackupRefused, match=r"below the 0.9"):
        restore(str(tmp_path / "b"), {"ledger": str(tmp_path / "ledger.json")}, force=True)
    assert not (tmp_path / "ledger.json").exists()


def test_restore_check_reads_every_part_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ledger_with(tmp_path / "ledger.json", 0.5)
    state = live_state(tmp_path)
    assert main(["backup", "--state", str(state), "--ledger", str(tmp_path / "ledger.json"),
                 "--out", str(tmp_path / "b.tar")]) == 0
    capsys.readouterr()
    assert main(["restore", str(tmp_path / "b.tar"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "coordinator: " in out and "ledger: " in out and "every digest matches" in out
    assert main(["restore", str(tmp_path / "b.tar"), "--spool", str(tmp_path / "sp")]) == 2
    assert "the backup holds no --spool (spool); it holds: coordinator, ledger" in capsys.readouterr().err
    assert not (tmp_path / "sp").exists()


def test_a_round_that_opens_while_the_spool_is_copied_makes_both_parts_copied_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fedbroker.app.backup as app_backup

    state = live_state(tmp_path)
    store = StateStore(str(state / "coordinator.sqlite"))  # the running coordinator's connection
    book = spool_with_an_open_round(tmp_path / "spool")
    real = spool_backup.backup_spool
    calls: list[str] = []

    def copy_while_the_coordinator_opens_a_round(spool_dir, root):
        calls.append(spool_dir)
        if len(calls) == 1:
            store.open_round("j-1", 1, ["w0"])
        return real(spool_dir, root)

    backers = {**app_backup._backers(), "spool": copy_while_the_coordinator_opens_a_round}
    monkeypatch.setattr(app_backup, "_backers", lambda: backers)
    try:
        backup({"spool": str(tmp_path / "spool"), "coordinator": str(state)}, str(tmp_path / "b"))
    finally:
        book.stop()
        store.close()
    assert len(calls) == 2
    restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})
    restored = StateStore.in_directory(str(tmp_path / "target"))
    assert [(r.job_id, r.round, r.status) for r in restored.rounds()] == [("j-1", 1, "open")]
    restored.close()


def test_a_restore_refused_for_one_target_writes_no_other(tmp_path: Path) -> None:
    ledger_with(tmp_path / "ledger.json", 0.5)
    backup({"coordinator": str(live_state(tmp_path)), "ledger": str(tmp_path / "ledger.json")}, str(tmp_path / "b"))
    with pytest.raises(BackupRefused, match="holds a ledger already"):
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target"), "ledger": str(tmp_path / "ledger.json")})
    assert not (tmp_path / "target").exists()


def test_a_manifest_naming_a_path_out_of_its_target_is_refused(tmp_path: Path) -> None:
    backup({"coordinator": str(live_state(tmp_path))}, str(tmp_path / "b"))
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["parts"]["coordinator"]["files"][0]["path"] = "../../outside"
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BackupRefused, match=r"malformed part entry .*'../../outside' is not a plain relative path"):
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})


def test_backup_refuses_an_output_that_holds_something_and_a_folder_without_state(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = live_state(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["backup", "--state", str(state), "--out", str(tmp_path / "full")]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert main(["backup", "--state", str(tmp_path / "full"), "--out", str(tmp_path / "b")]) == 2
    assert "holds no coordinator state (no coordinator.sqlite)" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


# ----- a backup that is not what its manifest says ----------------------------------------------------------


def rewrite_entry(backup: Path, path: str, **changes: object) -> None:
    """Change one file's entry in the manifest (as whoever edits a backup would, to make a changed file pass)."""
    manifest = json.loads((backup / "manifest.json").read_text())
    part, _, inner = path.partition("/")
    if inner:
        (entry,) = [f for f in manifest["parts"][part]["files"] if f["path"] == inner]
        entry.update(changes)
    else:
        manifest["parts"][part].update(changes)
    (backup / "manifest.json").write_text(json.dumps(manifest))


def test_a_restore_refuses_a_symbolic_link_inside_a_folder_backup_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backup({"coordinator": str(live_state(tmp_path))}, str(tmp_path / "b"))
    db = tmp_path / "b" / "coordinator" / "coordinator.sqlite"
    elsewhere = tmp_path / "elsewhere.sqlite"  # the very bytes, so only the link gives it away
    db.rename(elsewhere)
    db.symlink_to(elsewhere)
    capsys.readouterr()
    assert main(["restore", str(tmp_path / "b"), "--state", str(tmp_path / "target")]) == 1
    err = capsys.readouterr().err
    assert "coordinator/coordinator.sqlite is a symbolic link" in err, err
    assert not (tmp_path / "target").exists()

    db.unlink()  # a linked folder on the way is refused the same
    elsewhere.rename(db)
    (tmp_path / "b" / "coordinator").rename(tmp_path / "real")
    (tmp_path / "b" / "coordinator").symlink_to(tmp_path / "real")
    with pytest.raises(BackupRefused, match=r"coordinator is a symbolic link"):
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})
    assert not (tmp_path / "target").exists()


def test_an_archive_that_unpacks_past_its_limit_is_refused_naming_the_limit_before_that_member_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import tarfile

    import fedbroker.app.backup as app_backup

    bomb = tmp_path / "bomb.tar.gz"
    with tarfile.open(bomb, "w:gz") as tar:
        manifest = b'{"format": "fedbroker-backup/1", "parts": {}}'
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        info = tarfile.TarInfo("coordinator/coordinator.sqlite")
        info.size = 64 << 20  # 64 MiB of zeros: some 64 KiB packed
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    packed = bomb.stat().st_size
    assert packed * app_backup.UNPACK_RATIO < 64 << 20
    assert app_backup.unpack_limit(packed) == app_backup.UNPACK_FLOOR  # a real bomb meets the 1 GiB floor
    monkeypatch.setattr(app_backup, "UNPACK_FLOOR", 1 << 20)  # this one meets the ratio (quicker to make)
    unpacked: list[Path] = []
    real = tempfile.TemporaryDirectory

    def watched(*args: object, **kwargs: object) -> tempfile.TemporaryDirectory[str]:
        folder = real(*args, **kwargs)  # type: ignore[call-overload]
        unpacked.append(Path(folder.name))
        return folder  # type: ignore[no-any-return]

    monkeypatch.setattr(app_backup.tempfile, "TemporaryDirectory", watched)
    original_extract = tarfile.TarFile.extract
    written: list[str] = []

    def extract(self: tarfile.TarFile, member: tarfile.TarInfo, *args: object, **kwargs: object) -> None:
        written.append(member.name)
        original_extract(self, member, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tarfile.TarFile, "extract", extract)
    capsys.readouterr()
    assert main(["restore", str(bomb), "--state", str(tmp_path / "target")]) == 1
    err = capsys.readouterr().err
    limit = app_backup.unpack_limit(packed)
    assert f"unpacks to more than {limit} bytes" in err and f"{app_backup.UNPACK_RATIO}× its size" in err, err
    assert written == ["manifest.json"]  # the big member was never written
    assert unpacked and not any(p.exists() for p in unpacked) and not (tmp_path / "target").exists()


def test_a_restore_reads_the_schema_version_from_the_database_not_the_manifest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedbroker.backup import file_digest

    backup({"coordinator": str(live_state(tmp_path))}, str(tmp_path / "b"))
    db = tmp_path / "b" / "coordinator" / "coordinator.sqlite"
    edit = sqlite3.connect(db)
    edit.execute("PRAGMA user_version = 99")
    edit.close()
    sha, size = file_digest(db)
    rewrite_entry(tmp_path / "b", "coordinator/coordinator.sqlite", sha256=sha, bytes=size)  # digests pass
    capsys.readouterr()
    for argv in (["--check"], ["--state", str(tmp_path / "target")]):
        assert main(["restore", str(tmp_path / "b"), *argv]) == 1
        err = capsys.readouterr().err
        assert f"is at schema version 99, newer than the {SCHEMA.latest}" in err, err
    assert not (tmp_path / "target").exists()

    rewrite_entry(tmp_path / "b", "coordinator", version=99)  # the manifest agreeing changes nothing
    with pytest.raises(BackupRefused, match=r"schema version 99, newer than"):
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})


def test_a_negative_version_is_refused_as_invalid_not_as_newer(tmp_path: Path) -> None:
    from fedbroker.backup import file_digest
    from fedbroker.errors import Conflict

    backup({"coordinator": str(live_state(tmp_path))}, str(tmp_path / "b"))
    rewrite_entry(tmp_path / "b", "coordinator", version=-1)
    with pytest.raises(BackupRefused) as refused:
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})
    assert "version -1, which is invalid" in str(refused.value) and "newer" not in str(refused.value)

    rewrite_entry(tmp_path / "b", "coordinator", version=SCHEMA.latest)
    db = tmp_path / "b" / "coordinator" / "coordinator.sqlite"
    edit = sqlite3.connect(db)
    edit.execute("PRAGMA user_version = -1")
    edit.close()
    sha, size = file_digest(db)
    rewrite_entry(tmp_path / "b", "coordinator/coordinator.sqlite", sha256=sha, bytes=size)
    with pytest.raises(Conflict) as refused_db:
        restore(str(tmp_path / "b"), {"coordinator": str(tmp_path / "target")})
    message = str(refused_db.value)
    assert "schema version -1, which no fedbroker release writes (invalid, not newer)" in message, message
    assert not (tmp_path / "target").exists()
