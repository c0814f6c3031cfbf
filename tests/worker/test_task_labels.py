"""Labels for every task come out of a site's files typed as the task's loss takes them, and a hostile or broken
label file is refused at the door with every problem named (a label out of range, a NaN target, a mask of the
wrong shape)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedbroker.config import DataSection
from fedbroker.datasets import train_test_split
from fedbroker.datasets.npz import load_npz
from fedbroker.datasets.tables import load_csv, load_parquet
from fedbroker.errors import ConfigError, ConfigErrors


def _messages(exc: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    errors = exc.value.errors if isinstance(exc.value, ConfigErrors) else [exc.value]
    return [f"{e.field}: {e.problem}" for e in errors]


def test_multilabel_columns_of_a_csv_become_multi_hot_float_rows(tmp_path: Path) -> None:
    path = tmp_path / "findings.csv"
    path.write_text("a,b,effusion,nodule\n0.5,1,1,0\n0.1,2,0,0\n0.3,3,1,1\n")
    ds = load_csv(DataSection(path=str(path), labels="multilabel", label_columns=("effusion", "nodule")))
    assert ds.labels == "multilabel" and ds.y.dtype == np.float32 and ds.num_classes == 2
    assert ds.y.tolist() == [[1, 0], [0, 0], [1, 1]] and ds.x.shape == (3, 2)


def test_a_regression_target_column_becomes_float_targets(tmp_path: Path) -> None:
    path = tmp_path / "risk.csv"
    path.write_text("age,bp,risk\n50,120,0.25\n61,140,1.5\n")
    ds = load_csv(DataSection(path=str(path), labels="target", label_column="risk"))
    assert ds.y.tolist() == [0.25, 1.5] and ds.y.dtype == np.float32 and ds.num_classes == 1
    train, test = train_test_split(ds, test_fraction=0.5, seed=0)
    assert len(train) == len(test) == 1 and train.labels == "target"


def test_a_nan_target_in_a_csv_is_refused_naming_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "risk.csv"
    path.write_text("age,risk\n50,0.25\n61,nan\n")
    with pytest.raises(ConfigError, match="line 3, column 'risk'"):
        load_csv(DataSection(path=str(path), labels="target", label_column="risk"))


def test_parquet_multilabel_columns_are_read(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"f": [1.0, 2.0], "l1": [1, 0], "l2": [0, 1]}), path)
    ds = load_parquet(DataSection(path=str(path), labels="multilabel", label_columns=("l1", "l2")))
    assert ds.y.tolist() == [[1, 0], [0, 1]]


def test_segmentation_masks_in_an_npz_become_int_masks(tmp_path: Path) -> None:
    path = tmp_path / "seg.npz"
    np.savez(path, x=np.zeros((4, 1, 5, 6), np.float32), y=np.ones((4, 5, 6), np.uint8))
    ds = load_npz(DataSection(path=str(path), labels="mask", num_classes=2))
    assert ds.y.dtype == np.int64 and ds.y.shape == (4, 5, 6) and ds.num_classes == 2


def test_a_hostile_label_file_is_refused_with_every_problem_named(tmp_path: Path) -> None:
    path = tmp_path / "seg.npz"
    y = np.zeros((3, 5, 6), np.float64)
    y[0, 1, 2], y[1, 0, 0], y[2, 4, 5] = 7, np.nan, 0.5
    np.savez(path, x=np.zeros((3, 1, 5, 6), np.float32), y=y)
    with pytest.raises(ConfigErrors) as exc:
        load_npz(DataSection(path=str(path), labels="mask", num_classes=2))
    text = "\n".join(_messages(exc))
    assert "NaN or infinite at" in text and "'y'[1, 0, 0]" in text
    assert "must lie in 0..1" in text and "'y'[0, 1, 2]" in text
    assert "whole class indices" in text and "'y'[2, 4, 5]" in text


def test_a_mask_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "seg.npz"
    np.savez(path, x=np.zeros((2, 1, 5, 6), np.float32), y=np.zeros((2, 6, 5), np.int64))
    with pytest.raises(ConfigError, match=r"spatial size \[5, 6\]"):
        load_npz(DataSection(path=str(path), labels="mask", num_classes=2))


def test_multilabel_values_other_than_0_or_1_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ml.npz"
    np.savez(path, x=np.zeros((2, 3), np.float32), y=np.array([[1, 2], [0, 1]], np.float32))
    with pytest.raises(ConfigError, match=r"must be 0 or 1: other values at .*'y'\[0, 1\]"):
        load_npz(DataSection(path=str(path), labels="multilabel"))


def test_an_unknown_label_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="worker.data.labels"):
        DataSection(labels="pixels")
