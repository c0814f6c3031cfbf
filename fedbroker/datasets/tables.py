"""An owner's own table, CSV or Parquet: the header is checked (width, names) before any row is read, rows are
read as a stream in time linear in the file, and every refusal names the line or row and the column."""

from __future__ import annotations

import csv
import math
import operator
from array import array
from collections.abc import Callable, Iterator
from typing import TextIO

import numpy as np

from fedbroker.config import DataSection
from fedbroker.datasets.dataset import MAX_LINE_CHARS, MAX_VALUES, Dataset
from fedbroker.datasets.owned import columns, label_columns, number, own_dataset, task_dataset
from fedbroker.errors import ConfigError


class _Lines:
    """A CSV file's lines for `csv.reader`, refusing a line over MAX_LINE_CHARS or bytes that are not UTF-8.

    The file is decoded with `surrogateescape`, so a bad byte is found in the line that holds it (a strict
    decoder fails somewhere in an 8 KiB chunk, lines before or after it) and named by line and character.
    """

    def __init__(self, fh: TextIO, path: str) -> None:
        self.fh, self.path, self.number = fh, path, 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = self.fh.readline(MAX_LINE_CHARS + 1)
        if not line:
            raise StopIteration
        self.number += 1
        if len(line) > MAX_LINE_CHARS:
            raise ConfigError("worker.data.path", f"{self.path} line {self.number} is longer than {MAX_LINE_CHARS} "
                                                  f"characters")
        if not line.isascii():
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as error:  # an escaped byte: U+DC80..U+DCFF stand for 0x80..0xFF
                byte = ord(line[error.start]) - 0xDC00
                raise ConfigError("worker.data.path", f"{self.path} line {self.number}, character {error.start + 1}: "
                                                      f"byte 0x{byte:02x} is not UTF-8 (save the file as UTF-8)"
                                  ) from None
        return line


def _rows(reader: Iterator[list[str]], lines: _Lines) -> Iterator[list[str]]:
    """The reader's rows, its own errors (a field over csv.field_size_limit, a stray quote) naming the line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise ConfigError("worker.data.path", f"{lines.path} line {lines.number}: {exc}") from None
        yield row


def load_csv(source: DataSection) -> Dataset:
    """A header row naming the columns, then one sample a row (blank rows skipped)."""
    try:
        with open(source.path, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
            return _load_csv_text(fh, source)
    except OSError as exc:
        raise ConfigError("worker.data.path", f"{source.path} cannot be read: {exc.strerror}") from None


def _load_csv_text(fh: TextIO, source: DataSection) -> Dataset:
    path = source.path
    lines = _Lines(fh, path)
    rows = _rows(csv.reader(lines), lines)
    first = next(rows, None)
    if first is None:
        raise ConfigError("worker.data.path", f"{path} is empty: it needs a header row naming the columns")
    header = [name.strip() for name in first]
    if source.labels != "class":
        features, targets = label_columns(header, source, where=path)
        both, _, line_of = _read_rows(rows, lines, header, [*features, *targets], targets[0])
        cut = len(features)
        return task_dataset(both[:, :cut], _label_array(source, both[:, cut:]), source, name="csv",
                            where=lambda at: f"{path} line {line_of[at[0]]}, column {features[at[1]]!r}",
                            label_where=lambda at: f"{path} line {line_of[at[0]]}, column "
                                                   f"{targets[at[1] if len(at) > 1 else 0]!r}")
    features, label = columns(header, source, where=path)
    x, labels, line_of = _read_rows(rows, lines, header, features, label)
    return own_dataset(x, labels, source, name="csv",
                       where=lambda at: f"{path} line {line_of[at[0]]}, column {features[at[1]]!r}")


def _picker(positions: list[int]) -> Callable[[list[str]], tuple[str, ...]]:
    """The cells at `positions` of a row, as a tuple, in one C call (itemgetter of one index gives no tuple)."""
    if len(positions) == 1:
        at = positions[0]
        return lambda row: (row[at],)
    return operator.itemgetter(*positions)


def _read_rows(rows: Iterator[list[str]], lines: _Lines, header: list[str], features: list[str],
               label: str) -> tuple[np.ndarray, list[str], array[int]]:
    """Features (N, F) as float64, the raw labels, and the line each sample came from."""
    position = {name: i for i, name in enumerate(header)}  # names are unique: `columns` checked
    pick, at_label = _picker([position[c] for c in features]), position[label]
    most_rows = MAX_VALUES // len(features)
    values: array[float] = array("d")
    labels: list[str] = []
    line_of: array[int] = array("q")
    for row in rows:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise ConfigError("worker.data.path", f"{lines.path} line {lines.number}: {len(row)} fields, the header "
                                                  f"has {len(header)}")
        if len(labels) == most_rows:
            raise ConfigError("worker.data.path", f"{lines.path} line {lines.number}: more than {most_rows} rows of "
                                                  f"{len(features)} features, over the {MAX_VALUES} values a file "
                                                  f"may hold")
        cells = pick(row)
        try:
            numbers = list(map(float, cells))
        except ValueError:
            numbers = []
        if len(numbers) != len(cells) or not all(map(math.isfinite, numbers)):
            for cell, column in zip(cells, features):  # find the culprit only once there is one: keeps rows fast
                number(cell, f"{lines.path} line {lines.number}, column {column!r}")
        values.extend(numbers)
        labels.append(row[at_label].strip())
        line_of.append(lines.number)
    return np.frombuffer(values, dtype=np.float64).reshape(-1, len(features)), labels, line_of


def _label_array(source: DataSection, values: np.ndarray) -> np.ndarray:
    """Label columns as the kind wants them: one target column is (N,), several (N, k); multilabel is (N, L)."""
    if source.labels == "target" and values.shape[1] == 1:
        return values[:, 0]
    return values


def load_parquet(source: DataSection) -> Dataset:
    """Numeric feature columns without missing values, and a label column; sizes come from the footer first."""
    import pyarrow as pa  # imported lazily: only a Parquet owner needs it
    import pyarrow.parquet as pq

    path = source.path
    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError("worker.data.path", f"{path} is not a readable Parquet file: {exc}") from None
    names = list(meta.schema.to_arrow_schema().names)
    targets: list[str] = []
    if source.labels != "class":
        features, targets = label_columns(names, source, where=path)
        label = targets[0]
    else:
        features, label = columns(names, source, where=path)
    if meta.num_rows * len(features) > MAX_VALUES:
        raise ConfigError("worker.data.path", f"{path}: the footer declares {meta.num_rows} rows of {len(features)} "
                                              f"features, over the {MAX_VALUES} values a file may hold")
    try:
        table = pq.read_table(path, columns=[*features, *(targets or [label])])
    except (pa.ArrowException, OSError) as exc:  # a corrupt page, or one inflating past what it declared
        raise ConfigError("worker.data.path", f"{path} is not a readable Parquet file: {exc}") from None
    x = np.empty((len(table), len(features)), dtype=np.float64)
    for j, name in enumerate(features):
        column = table.column(name)
        kind = column.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise ConfigError("worker.data.feature_columns", f"{path} column {name!r} holds {kind}, not numbers")
        if column.null_count:
            raise ConfigError("worker.data.path", f"{path} column {name!r} has {column.null_count} missing values")
        x[:, j] = column.to_numpy()
    if targets:
        y = np.empty((len(table), len(targets)), dtype=np.float64)
        for j, name in enumerate(targets):
            column = table.column(name)
            if column.null_count or not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
                                         or pa.types.is_boolean(column.type)):
                raise ConfigError("worker.data.label_columns", f"{path} column {name!r} must hold numbers without "
                                                               f"missing values, got {column.type}")
            y[:, j] = column.to_numpy()
        return task_dataset(x, _label_array(source, y), source, name="parquet",
                            where=lambda at: f"{path} column {features[at[1]]!r}, row index {at[0]}",
                            label_where=lambda at: f"{path} column {targets[at[1] if len(at) > 1 else 0]!r}, "
                                                   f"row index {at[0]}")
    labels = table.column(label)
    if labels.null_count:
        raise ConfigError("worker.data.label_column", f"{path} column {label!r} has {labels.null_count} "
                                                      f"missing labels")
    return own_dataset(x, [str(v) for v in labels.to_pylist()], source, name="parquet",
                       where=lambda at: f"{path} column {features[at[1]]!r}, row index {at[0]}")

