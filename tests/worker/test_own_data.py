"""A data owner's own files (worker.dataset csv | npz | parquet | idx): each test writes its own small file,
and every bad file is refused with an error naming the setting to fix."""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedbroker.config import DataSection, DPPolicy, WorkerConfig, load_config
from fedbroker.coordinator.control import InvalidControlMessage, check_control
from fedbroker.coordinator.participants import data_fit_problems
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.datasets import load_worker_data
from fedbroker.errors import ConfigError
from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb


def worker(dataset: str, **data: object) -> WorkerConfig:
    return WorkerConfig(dataset=dataset, data=DataSection(**data))  # type: ignore[arg-type]


def write_csv(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ----- CSV -----


def test_csv_reads_the_declared_feature_columns_in_order_and_the_label(tmp_path):
    path = write_csv(tmp_path / "t.csv", "age,id,weight,label\n30,7,70.5,1\n40,8,80,0\n50,9,90,2\n")
    ds = load_worker_data(worker("csv", path=path, feature_columns=("weight", "age")))
    assert ds.x.dtype == np.float32 and ds.x.tolist() == [[70.5, 30.0], [80.0, 40.0], [90.0, 50.0]]
    assert ds.y.tolist() == [1, 0, 2] and ds.num_classes == 3 and ds.input_shape == (2,)


def test_csv_standardisation_uses_this_workers_own_mean_and_std(tmp_path):
    rows = "\n".join(f"{v},{10 * v + 3},5,{v % 2}" for v in range(1, 21))
    path = write_csv(tmp_path / "t.csv", f"a,b,constant,label\n{rows}\n")
    ds = load_worker_data(worker("csv", path=path, standardize=True))
    np.testing.assert_allclose(ds.x[:, :2].mean(axis=0), 0.0, atol=1e-6)
    np.testing.assert_allclose(ds.x[:, :2].std(axis=0), 1.0, atol=1e-6)
    assert (ds.x[:, 2] == 0).all()  # a constant feature stays 0 instead of becoming NaN
    raw = load_worker_data(worker("csv", path=path))
    assert raw.x[0].tolist() == [1.0, 13.0, 5.0]
    for mode in ("none", "federated"):  # federated: raw here, standardised by the model's first layer
        assert load_worker_data(worker("csv", path=path, standardize=mode)).x[0].tolist() == [1.0, 13.0, 5.0]
    np.testing.assert_array_equal(load_worker_data(worker("csv", path=path, standardize="site")).x, ds.x)


def test_csv_text_labels_are_numbered_by_the_declared_classes(tmp_path):
    path = write_csv(tmp_path / "t.csv", "x,diagnosis\n1,benign\n2,malignant\n3,benign\n")
    ds = load_worker_data(worker("csv", path=path, label_column="diagnosis", classes=("benign", "malignant", "other")))
    assert ds.y.tolist() == [0, 1, 0] and ds.num_classes == 3  # a class this owner lacks still counts
    with pytest.raises(ConfigError, match="'malignant'") as info:
        load_worker_data(worker("csv", path=path, label_column="diagnosis", classes=("benign",)))
    assert info.value.field == "worker.data.classes"
    with pytest.raises(ConfigError, match="label 'benign' is not a class index") as info:
        load_worker_data(worker("csv", path=path, label_column="diagnosis"))
    assert info.value.field == "worker.data.classes"


@pytest.mark.parametrize(("text", "options", "field", "message"), [
    ("a,b\n1,2\n", {}, "worker.data.label_column", "has no column 'label'; its columns: a, b"),
    ("a,label\n1,0\n", {"feature_columns": ("a", "z")}, "worker.data.feature_columns", "has no column 'z'"),
    ("a,label\n1,0\n", {"feature_columns": ("label",)}, "worker.data.feature_columns", "lists the label column"),
    ("a,label\n1,0\nx,1\n", {}, "worker.data.path", "line 3, column 'a': 'x' is not a number"),
    ("a,label\n1,0\nnan,1\n", {}, "worker.data.path", "line 3, column 'a': 'nan' is not a finite number"),
    ("a,label\n1,0\n2\n", {}, "worker.data.path", "line 3: 1 fields, the header has 2"),
    ("a,label\n", {}, "worker.data.path", "holds no samples"),
    ("a,label\n1,-1\n", {}, "worker.data.classes", "label '-1' is not a class index"),
    ("a,label\n1,4\n", {"num_classes": 3}, "worker.data.num_classes", "is 3 but the labels reach 4"),
    ("a,label\n1,4\n", {"num_classes": 70000}, "worker.data.num_classes", "must lie in [1, 65536], got 70000"),
    ("a,a,label\n1,2,0\n", {}, "worker.data.path", "names the columns 'a' more than once"),
])
def test_a_bad_csv_is_refused_naming_the_setting_and_the_place(tmp_path, text, options, field, message):
    path = write_csv(tmp_path / "t.csv", text)
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_worker_data(worker("csv", path=path, **options))
    assert info.value.field == field


def test_own_data_without_a_path_or_with_a_missing_file_names_the_path_setting(tmp_path):
    for options in ({}, {"path": str(tmp_path / "nowhere.csv")}):
        with pytest.raises(ConfigError) as info:
            load_worker_data(worker("csv", **options))
        assert info.value.field == "worker.data.path"


def test_unknown_data_set_lists_the_bundled_sets_and_the_own_formats():
    with pytest.raises(ConfigError, match="known: digits, .*idx, csv, npz, parquet") as info:
        load_worker_data(WorkerConfig(dataset="excel"))
    assert info.value.field == "worker.dataset"


def test_the_data_section_comes_from_the_environment_as_kubernetes_sets_it(tmp_path):
    path = write_csv(tmp_path / "t.csv", "a,b,c,y\n1,2,3,0\n4,5,6,1\n")
    config = load_config(environ={
        "FEDBROKER__WORKER__DATASET": "csv", "FEDBROKER__WORKER__DATA__PATH": path,
        "FEDBROKER__WORKER__DATA__LABEL_COLUMN": "y", "FEDBROKER__WORKER__DATA__FEATURE_COLUMNS": "c,a",
        "FEDBROKER__WORKER__DATA__STANDARDIZE": "true", "FEDBROKER__WORKER__DATA__NUM_CLASSES": "4",
    })
    assert config.worker.data.feature_columns == ("c", "a") and config.worker.data.standardize == "site"
    ds = load_worker_data(config.worker)
    assert ds.input_shape == (2,) and ds.num_classes == 4
    with pytest.raises(ConfigError, match="worker.data.colour: unknown setting"):
        load_config(environ={"FEDBROKER__WORKER__DATA__COLOUR": "red"})


# ----- npz -----


def test_npz_reads_the_named_arrays_keeping_the_sample_shape(tmp_path):
    path = tmp_path / "d.npz"
    images = np.arange(5 * 16, dtype=np.uint8).reshape(5, 1, 4, 4)
    np.savez(path, pixels=images, target=np.array([0.0, 1.0, 2.0, 1.0, 0.0]), extra=np.zeros(3))
    ds = load_worker_data(worker("npz", path=str(path), features_key="pixels", labels_key="target"))
    assert ds.x.shape == (5, 1, 4, 4) and ds.input_shape == (1, 4, 4) and ds.x.dtype == np.float32
    assert ds.x[1, 0, 0, 0] == 16.0 and ds.y.tolist() == [0, 1, 2, 1, 0] and ds.num_classes == 3


def test_npz_names_the_arrays_it_holds_when_a_key_is_missing(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, a=np.zeros((2, 3)), b=np.zeros(2, dtype=np.int64))
    with pytest.raises(ConfigError, match="holds no array 'x'; it holds a, b") as info:
        load_worker_data(worker("npz", path=str(path)))
    assert info.value.field == "worker.data.features_key"


def test_npz_object_arrays_are_refused_without_unpickling(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.array([{"a": 1}, {"b": 2}], dtype=object), y=np.array([0, 1]))
    with pytest.raises(ConfigError, match="pickle") as info:
        load_worker_data(worker("npz", path=str(path)))
    assert info.value.field == "worker.data.path"


def test_a_lone_npy_array_is_not_taken_for_an_archive(tmp_path):
    path = tmp_path / "d.npz"
    with open(path, "wb") as fh:
        np.save(fh, np.zeros((3, 2)))
    with pytest.raises(ConfigError, match="single .npy array, not an .npz archive"):
        load_worker_data(worker("npz", path=str(path)))


def test_npz_samples_no_model_can_take_are_refused(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((2, 1, 1, 2, 2)), y=np.zeros(2, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"one sample's shape \[1, 1, 2, 2\] cannot be a model's input"):
        load_worker_data(worker("npz", path=str(path)))


def test_npz_labels_must_match_the_samples(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((4, 3)), y=np.zeros(3, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"one label per sample \(4\)") as info:
        load_worker_data(worker("npz", path=str(path)))
    assert info.value.field == "worker.data.labels_key"


# ----- Parquet -----


def test_parquet_reads_numeric_columns_and_text_labels(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"height": [1.5, 2.5, 3.5], "count": [1, 2, 3], "kind": ["b", "a", "b"]}), path)
    ds = load_worker_data(worker("parquet", path=path, label_column="kind", classes=("a", "b")))
    assert ds.x.tolist() == [[1.5, 1.0], [2.5, 2.0], [3.5, 3.0]] and ds.y.tolist() == [1, 0, 1]


def test_parquet_missing_values_and_text_features_are_refused(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"a": [1.0, None], "label": [0, 1]}), path)
    with pytest.raises(ConfigError, match="column 'a' has 1 missing values"):
        load_worker_data(worker("parquet", path=path))
    pq.write_table(pa.table({"a": ["x", "y"], "label": [0, 1]}), path)
    with pytest.raises(ConfigError, match="column 'a' holds string, not numbers") as info:
        load_worker_data(worker("parquet", path=path))
    assert info.value.field == "worker.data.feature_columns"
    Path(path).write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        load_worker_data(worker("parquet", path=path))


# ----- IDX (the setting deploy/OPERATING.md promises) -----


def idx_bytes(array: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def test_dataset_idx_reads_the_owners_train_files_with_its_own_image_size_and_classes(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, size=(6, 12, 12), dtype=np.uint8)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(images))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([0, 1, 2, 0, 1, 2], np.uint8)))
    config = load_config(environ={"FEDBROKER__WORKER__DATASET": "idx", "FEDBROKER__WORKER__IDX_DIR": str(tmp_path)})
    ds = load_worker_data(config.worker)
    assert ds.x.shape == (6, 1, 12, 12) and ds.num_classes == 3 and ds.x.max() <= 1.0
    np.testing.assert_allclose(ds.x[2, 0], images[2] / 255.0, rtol=1e-6)
    os.remove(tmp_path / "train-labels-idx1-ubyte")
    with pytest.raises(ConfigError, match="train-labels-idx1-ubyte"):
        load_worker_data(config.worker)
    with pytest.raises(ConfigError, match="worker.idx_dir") as info:
        load_worker_data(WorkerConfig(dataset="idx"))
    assert info.value.field == "worker.idx_dir"


# ----- what the worker reports, and what the coordinator does with it -----


def record(worker_id: str, shape: tuple[int, ...], classes: int) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, categories=("c",), histogram=(), dp=DPPolicy(enabled=False),
                        epsilon_spent=0.0, device="cpu", num_samples=10, last_seen=0.0, input_shape=shape,
                        num_classes=classes)


def test_a_model_is_checked_against_every_reporting_worker_of_the_category():
    model = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3},
                                                        {"type": "ReLU"}]})
    fits = [record("a", (4,), 3), record("b", (4,), 2), record("old", (), 0)]
    assert data_fit_problems(model, fits, category="c") == []
    problems = data_fit_problems(model, [*fits, record("x", (5,), 3), record("y", (4,), 7)], category="c")
    assert [p.field for p in problems] == ["model.input_shape", "model.layers[0].out_features"]
    assert "samples of worker x (category 'c') have shape [5]" in str(problems[0])
    assert "outputs 3 class scores but the data of worker y (category 'c') has 7 classes" in str(problems[1])


def test_a_registration_with_an_impossible_shape_or_class_count_is_refused():
    ok = pb.Registration(worker_id="w", categories=["c"], num_samples=5, device="cpu", input_shape=[1, 8, 8],
                         num_classes=10)
    check_control(pb.Envelope(registration=ok))
    for bad, problem in (({"input_shape": [0]}, "input_shape"), ({"input_shape": [2] * 9}, "input_shape"),
                         ({"num_classes": -1}, "num_classes"), ({"num_classes": 10**6}, "num_classes"),
                         ({"num_classes": 3, "label_histogram": [1, 2]}, "num_classes: is 3 but label_histogram has 2")):
        message = pb.Registration()
        message.CopyFrom(ok)
        for key, value in bad.items():
            if key in ("input_shape", "label_histogram"):
                del getattr(message, key)[:]
                getattr(message, key).extend(value)
            else:
                setattr(message, key, value)
        with pytest.raises(InvalidControlMessage, match=problem):
            check_control(pb.Envelope(registration=message))
