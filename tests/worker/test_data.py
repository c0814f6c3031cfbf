import gzip
import os
import struct

import numpy as np
import pytest

from fedbroker.datasets import DATASETS, Dataset, load_dataset, load_idx, train_test_split
from fedbroker.errors import ConfigError

_TYPE_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int16): 0x0B, np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D}


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, _TYPE_CODES[array.dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def _write(path: str, data: bytes, *, gz: bool = False) -> str:
    with (gzip.open if gz else open)(path, "wb") as fh:
        fh.write(data)
    return path


@pytest.mark.parametrize(
    ("name", "shape", "num_classes"),
    [
        ("digits", (1797, 1, 8, 8), 10),
        ("breast_cancer", (569, 30), 2),
        ("wine", (178, 13), 3),
        ("iris", (150, 4), 3),
    ],
)
def test_bundled_sets_have_the_documented_shape_dtype_and_labels(name, shape, num_classes):
    ds = load_dataset(name)
    assert ds.x.shape == shape and ds.input_shape == shape[1:]
    assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64
    assert ds.num_classes == num_classes and set(np.unique(ds.y)) == set(range(num_classes))
    assert np.isfinite(ds.x).all() and ds.name == name


def test_digits_pixels_are_scaled_to_the_unit_interval():
    x = load_dataset("digits").x
    assert x.min() == 0.0 and x.max() == 1.0


@pytest.mark.parametrize("name", ["breast_cancer", "wine", "iris"])
def test_tabular_features_are_standardised_over_the_whole_set(name):
    x = load_dataset(name).x.astype(np.float64)
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(axis=0), 1.0, atol=1e-5)


def test_unknown_data_set_error_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        load_dataset("cifar10")
    assert info.value.field == "dataset"
    assert all(name in str(info.value) for name in DATASETS)


def test_split_is_stratified_disjoint_and_complete():
    y = load_dataset("digits").y
    ds = Dataset(x=np.arange(len(y), dtype=np.float32)[:, None], y=y, num_classes=10, name="ids")
    train, test = train_test_split(ds, test_fraction=0.2, seed=3)
    ids = np.concatenate([train.x[:, 0], test.x[:, 0]]).astype(np.int64)
    np.testing.assert_array_equal(np.sort(ids), np.arange(len(y)))
    np.testing.assert_array_equal(y[test.x[:, 0].astype(np.int64)], test.y)
    assert np.all(np.abs(np.bincount(test.y, minlength=10) - 0.2 * np.bincount(y)) <= 0.5)


def test_split_is_deterministic_for_a_seed_and_varies_with_it():
    ds = load_dataset("wine")
    a, b, c = (train_test_split(ds, seed=s)[1] for s in (1, 1, 2))
    np.testing.assert_array_equal(a.x, b.x)
    assert not np.array_equal(a.x, c.x)


def test_split_rejects_a_fraction_outside_zero_one():
    with pytest.raises(ConfigError, match="test_fraction"):
        train_test_split(load_dataset("iris"), test_fraction=1.0)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.float32])
def test_idx_round_trip_plain_and_gzip(tmp_path, gz, dtype):
    array = (np.arange(2 * 3 * 5) - 7).astype(dtype).reshape(2, 3, 5) if dtype != np.uint8 else (
        np.arange(30, dtype=np.uint8).reshape(2, 3, 5)
    )
    path = _write(str(tmp_path / ("a.idx" + (".gz" if gz else ""))), _idx_bytes(array), gz=gz)
    loaded = load_idx(path)
    assert loaded.dtype == np.dtype(dtype) and loaded.dtype.isnative
    np.testing.assert_array_equal(loaded, array)


def test_idx_with_bad_magic_is_rejected_clearly(tmp_path):
    path = _write(str(tmp_path / "bad"), b"\x12\x34\x08\x01" + struct.pack(">I", 1) + b"\x00")
    with pytest.raises(ConfigError, match="bad IDX magic") as info:
        load_idx(path)
    assert info.value.field == path


@pytest.mark.parametrize("cut", [3, 6, -1])
def test_truncated_idx_file_is_rejected_clearly(tmp_path, cut):
    data = _idx_bytes(np.zeros((4, 2), dtype=np.uint8))
    path = _write(str(tmp_path / "short"), data[:cut])
    with pytest.raises(ConfigError, match="truncated"):
        load_idx(path)


def test_truncated_gzip_is_rejected_clearly(tmp_path):
    full = gzip.compress(_idx_bytes(np.zeros((100, 10), dtype=np.uint8)))
    path = _write(str(tmp_path / "short.gz"), full[: len(full) // 2])
    with pytest.raises(ConfigError, match="gzip"):
        load_idx(path)


def test_idx_with_trailing_bytes_is_rejected(tmp_path):
    path = _write(str(tmp_path / "long"), _idx_bytes(np.zeros(3, dtype=np.uint8)) + b"\x00")
    with pytest.raises(ConfigError, match="trailing"):
        load_idx(path)


def _write_mnist_dir(directory, *, n_train=5, n_test=3, gz=True, skip=()):
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        for stem, array in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
            if stem not in skip:
                _write(os.path.join(directory, stem + suffix), _idx_bytes(array), gz=gz)


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
@pytest.mark.parametrize("gz", [False, True])
def test_idx_data_set_pools_train_and_test_scaled_to_unit_interval(tmp_path, name, gz):
    _write_mnist_dir(tmp_path, gz=gz)
    ds = load_dataset(name, idx_dir=str(tmp_path))
    assert ds.x.shape == (8, 1, 28, 28) and ds.x.dtype == np.float32
    assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0
    assert ds.y.dtype == np.int64 and ds.num_classes == 10 and ds.name == name


def test_missing_idx_file_is_named_in_the_error(tmp_path):
    _write_mnist_dir(tmp_path, skip=("t10k-labels-idx1-ubyte",))
    with pytest.raises(ConfigError, match="t10k-labels-idx1-ubyte"):
        load_dataset("mnist", idx_dir=str(tmp_path))


def test_idx_data_set_without_a_directory_says_what_it_needs():
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte") as info:
        load_dataset("fashion_mnist")
    assert info.value.field == "idx_dir"


def test_dataset_rejects_mismatched_labels():
    with pytest.raises(ConfigError, match="labels"):
        Dataset(x=np.zeros((3, 2), np.float32), y=np.zeros(2, np.int64), num_classes=2, name="t")
