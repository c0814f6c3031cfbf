"""The one atomic writer (spool, privacy ledger, checkpoints): all or nothing, no leftovers, owner-only."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

import pytest

from fedbroker.files import write_atomic


def mode_of(path: os.PathLike[str]) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_writes_bytes_or_a_writer_function_owner_only_and_leaves_no_temp_file(tmp_path):
    write_atomic(tmp_path / "a.bin", b"hello")

    def writer(fh: BinaryIO) -> None:
        fh.write(b"from ")
        fh.write(b"a function")

    write_atomic(tmp_path / "b.bin", writer)
    assert (tmp_path / "a.bin").read_bytes() == b"hello"
    assert (tmp_path / "b.bin").read_bytes() == b"from a function"
    assert mode_of(tmp_path / "a.bin") == mode_of(tmp_path / "b.bin") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]


def test_a_caller_may_ask_for_another_mode(tmp_path):
    write_atomic(tmp_path / "shared.json", b"{}", mode=0o644)
    assert mode_of(tmp_path / "shared.json") == 0o644


def test_replacing_a_file_keeps_its_new_mode_not_the_old_one(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    path.chmod(0o666)
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and mode_of(path) == 0o600


def test_a_failure_mid_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "ledger.json"
    write_atomic(path, b"old contents")

    def dies_half_way(fh: BinaryIO) -> None:
        fh.write(b"new con")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, dies_half_way)
    assert path.read_bytes() == b"old contents"
    assert [p.name for p in tmp_path.iterdir()] == ["ledger.json"]


def test_a_failed_rename_leaves_no_temp_file(tmp_path, monkeypatch):
    def no_rename(src: str, dst: object) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(PermissionError):
        write_atomic(tmp_path / "x", b"data")
    assert list(tmp_path.iterdir()) == []
