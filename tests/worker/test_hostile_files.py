"""Hostile data files are refused at the door: a ConfigError naming the setting and the place in the file, read
at start, before a worker registers or spends ε; never a traceback, a MemoryError, a hang, or a NaN met in
round 2. Each test writes its own small file; none asserts a time, but each finishes in seconds on any code
that handles columns in linear time and checks declared sizes before inflating."""

from __future__ import annotations

import gzip
import os
import re
import struct
import subprocess
import sys
import tracemalloc
import zipfile
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedbroker.bus import delete_topology
from fedbroker.config import DataSection, WorkerConfig
from fedbroker.datasets import load_idx, load_worker_data
from fedbroker.errors import ConfigError
from tests.source_roots import PYTHONPATH

pytestmark = pytest.mark.timeout(300)  # a hang guard only: a quadratic reader or a bomb would run for minutes


def worker(dataset: str, **data: object) -> WorkerConfig:
    return WorkerConfig(dataset=dataset, data=DataSection(**data))  # type: ignore[arg-type]


def refused(config: WorkerConfig, field: str, message: str) -> ConfigError:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_worker_data(config)
    assert info.value.field == field
    return info.value


# ----- values no model can train on, in every format -----


@pytest.mark.parametrize("standardize", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_parquet_value_is_refused_at_start_naming_its_column_and_row(tmp_path, standardize, value):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"a": [1.0, 2.0, 3.0], "b": [0.5, value, 1.5], "label": [0, 1, 0]}), path)
    refused(worker("parquet", path=path, standardize=standardize), "worker.data.path",
            f"{path} column 'b', row index 1: {value!r} is not a finite number")


@pytest.mark.parametrize(("cell", "message"), [
    ("inf", "line 3, column 'b': 'inf' is not a finite number"),
    ("1e39", "line 3, column 'b': 1e+39 does not fit a 32-bit float"),  # finite in float64, inf once float32
])
def test_a_csv_value_no_float32_can_hold_is_refused_naming_its_line_and_column(tmp_path, cell, message):
    path = tmp_path / "t.csv"
    path.write_text(f"a,b,label\n1,2,0\n3,{cell},1\n")
    refused(worker("csv", path=str(path), standardize=True), "worker.data.path", message)


@pytest.mark.parametrize("value", [np.inf, -1e300])
def test_a_non_finite_npz_value_is_refused_naming_its_index(tmp_path, value):
    path = tmp_path / "d.npz"
    x = np.zeros((3, 2, 4))
    x[1, 0, 2] = value
    np.savez(path, x=x, y=np.array([0, 1, 0]))
    refused(worker("npz", path=str(path)), "worker.data.path", f"{path}: 'x'[1, 0, 2]: {float(value)!r}")


# ----- a CSV: width checked on the header, linear time, encoding, line and field sizes -----


def test_a_csv_of_200k_columns_is_refused_from_its_header(tmp_path):
    path = tmp_path / "wide.csv"
    header = ",".join(f"c{i}" for i in range(199_999))
    path.write_text(f"{header},label\n" + ("0," * 199_999 + "1\n") * 2)
    refused(worker("csv", path=str(path)), "worker.data.path",
            "199999 feature columns, more than the 65536 a model's input can take; list the ones to use in "
            "worker.data.feature_columns")


def test_a_header_of_300k_columns_is_refused_even_when_three_are_declared(tmp_path):
    path = tmp_path / "wider.csv"
    path.write_text(",".join(f"c{i}" for i in range(300_000)) + ",label\n")
    refused(worker("csv", path=str(path), feature_columns=("c0", "c1", "c2")), "worker.data.path",
            "the header names 300001 columns, more than the 262144 a table may have")


def test_a_csv_of_60k_declared_feature_columns_loads(tmp_path):
    names = [f"c{i}" for i in range(60_000)]
    path = tmp_path / "wide.csv"
    path.write_text(",".join([*names, "label"]) + "\n" + "".join(",".join(["1"] * 60_000 + [str(k)]) + "\n"
                                                                for k in range(3)))
    ds = load_worker_data(worker("csv", path=str(path), feature_columns=tuple(reversed(names))))
    assert ds.input_shape == (60_000,) and ds.y.tolist() == [0, 1, 2]


def test_bytes_that_are_not_utf8_are_refused_naming_the_line_and_character(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"a,label\n" + b"1,0\n" * 4000 + b"12\xff4,0\n5,1\n")  # the bad byte well past 8 KiB
    refused(worker("csv", path=str(path)), "worker.data.path",
            f"{path} line 4002, character 3: byte 0xff is not UTF-8")


@pytest.mark.parametrize("quote", ["", '"'])
def test_a_200kb_field_is_refused_naming_its_line(tmp_path, quote):
    path = tmp_path / "t.csv"
    path.write_text(f"a,label\n1,0\n{quote}{'9' * 200_000}{quote},1\n")
    refused(worker("csv", path=str(path)), "worker.data.path", f"{path} line 3: field larger than field limit")


def test_a_line_over_the_limit_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr("fedbroker.datasets.tables.MAX_LINE_CHARS", 1000)
    path = tmp_path / "t.csv"
    path.write_text("a,b,label\n1,2,0\n" + ",".join(["1" * 90] * 20) + "\n")
    refused(worker("csv", path=str(path)), "worker.data.path", f"{path} line 3 is longer than 1000 characters")


# ----- npz: sizes declared by the zip directory and the .npy header, checked before inflating -----


def npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


@pytest.mark.parametrize("shape", [(2**30, 1), (2**40, 2)])  # 8 GiB, 16 TiB, in an archive of a few hundred bytes
def test_an_npz_member_declaring_a_huge_array_is_refused_from_its_header(tmp_path, shape):
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", npy_header(shape))
        archive.writestr("y.npy", npy_header((shape[0],), "<i8"))
    assert path.stat().st_size < 1000
    refused(worker("npz", path=str(path)), "worker.data.path",
            f"{path} member 'x.npy': its .npy header declares shape {list(shape)} of float64")


def test_an_npz_member_whose_zip_directory_declares_4gib_is_refused_before_inflating(tmp_path):
    path = tmp_path / "lie.npz"
    x = np.zeros((4, 2))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:  # np.savez writes zip64 sizes
        archive.writestr("x.npy", npy_header(x.shape) + x.tobytes())
        archive.writestr("y.npy", npy_header((4,), "<i8") + bytes(32))
    data = bytearray(path.read_bytes())
    central = data.index(b"PK\x01\x02")  # the first member's entry in the central directory: x.npy
    struct.pack_into("<I", data, central + 24, 2**32 - 2)  # its uncompressed size: 4 GiB from ~100 bytes
    path.write_bytes(bytes(data))
    refused(worker("npz", path=str(path)), "worker.data.path",
            f"{path} member 'x.npy': the zip directory declares 4294967294 bytes")


# ----- IDX, plain and gzip: dims checked before reading, gzip inflated only as far as they reach -----


def idx_header(dims: tuple[int, ...], code: int = 0x08) -> bytes:
    return bytes([0, 0, code, len(dims)]) + struct.pack(f">{len(dims)}I", *dims)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_dims_beyond_the_limit_are_refused_from_the_header(tmp_path, gz):
    path = tmp_path / "train-images-idx3-ubyte"
    raw = idx_header((2**16, 2**16, 2**16)) + bytes(1000)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    with pytest.raises(ConfigError, match=re.escape("header bytes 4..16 declare dims (65536, 65536, 65536)")):
        load_idx(str(path))


def test_an_idx_gzip_bomb_is_refused_without_inflating_it(tmp_path):
    """A few hundred KiB of gzip behind a small honest header inflates to 256 MiB: read up to the header's dims
    and one byte more, then refused, never held in memory."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    chunks = [deflate.compress(idx_header((10, 28, 28)) + bytes(7840))]
    zeros = bytes(2**20)
    chunks += [deflate.compress(zeros) for _ in range(256)]
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(b"".join([*chunks, deflate.flush()]))
    assert path.stat().st_size < 2**20
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="unexpected trailing bytes after byte 7856 of the inflated data"):
            load_idx(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


def test_a_non_finite_float_idx_value_is_refused_naming_its_index(tmp_path):
    path = tmp_path / "floats"
    path.write_bytes(idx_header((2, 3), 0x0D) + np.array([0, 1, 2, 3, np.nan, 5], ">f4").tobytes())
    with pytest.raises(ConfigError, match=re.escape("at index [1, 1]: nan is not a finite number")):
        load_idx(str(path))


def test_a_refused_idx_file_names_the_worker_setting(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(gzip.compress(idx_header((2**16, 2**16, 2**16))))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_header((1,)) + b"\x00")
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte: header bytes 4..16 declare") as info:
        load_worker_data(WorkerConfig(dataset="idx", idx_dir=str(tmp_path)))
    assert info.value.field == "worker.idx_dir"


# ----- a real worker process refuses at start -----


@pytest.mark.integration
def test_a_worker_process_refuses_a_nan_parquet_at_start_before_registering(tmp_path, rabbitmq_url):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"a": [1.0, float("nan"), 3.0, 4.0], "label": [0, 1, 0, 1]}), str(path))
    ledger = tmp_path / "ledger.json"
    namespace = f"hostile-files-{os.getpid()}"
    settings = {
        "broker.url": rabbitmq_url, "broker.namespace": namespace, "worker.id": "hostile-a",
        "worker.dataset": "parquet", "worker.data.path": str(path), "worker.data.standardize": "true",
        "worker.ledger_path": str(ledger), "worker.device": "cpu", "worker.dp.enabled": "true",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env.update({"FEDBROKER__" + k.upper().replace(".", "__"): v for k, v in settings.items()})
    env["PYTHONPATH"] = PYTHONPATH
    try:
        done = subprocess.run([sys.executable, "-m", "fedbroker", "worker"], env=env, capture_output=True,
                              text=True, timeout=240, cwd=tmp_path)
    finally:  # were the worker to get past its data, it would leave its queues behind
        delete_topology(rabbitmq_url, namespace, ["hostile-a"])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"fedbroker worker: config: worker.data.path: {path} column 'a', row index 1: nan is not a finite number")
    assert not ledger.exists()  # no ledger opened, so no ε could have been spent
    assert "register" not in done.stderr.lower()
