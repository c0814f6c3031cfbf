"""A folder of PNG or JPEG images on the site's disk (`worker.dataset: images`), read a batch at a time.

`worker.data.path` is the folder. `worker.data.labels_csv` is the index: one row per sample, its `file_column`
a path relative to the folder, and its label as `worker.data.labels` says: `class` (`label_column`, names mapped
by `classes`), `multilabel` (`label_columns`, 0/1 per finding), `target` (`label_column` or `label_columns`), or
`mask`: `worker.data.masks` is a folder of PNG masks paired by name (`scans/a.jpg` ↔ `<masks>/scans/a.png`), of
the image's size, values 0..num_classes−1. With masks and no CSV, every image directly in the folder is a sample.

Refused at the door, before the worker registers or spends ε, every problem at once (the first files of each
kind and their count), each file named: a folder of more than `MAX_FILES` files (counted, never listed whole), a
CSV row naming a missing file, a file named twice, a path leaving the folder (`..`, absolute, a link), a file
that is not a PNG or JPEG, that cannot be read or is not a regular file; sizes from the headers before any pixel
is decoded (absurd dimensions, over `MAX_PIXELS`, Pillow's decompression bombs, over `MAX_TOTAL_VALUES` in all);
then every file decoded once, one at a time (a truncated file, a transparent pixel); masks missing, of another
size, or out of range (a 0/255 mask gets a hint). `fedbroker.datasets.image_files` reads one file.

The samples are `FileSamples` (fedbroker.datasets.stream): float32 (C, H, W) in [0, 1], decoded when a batch
asks; a size that differs between files is 0 in the sample shape (the job's data section resizes them). Masks
are `FileSamples` too, int64 (H, W).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from tqdm import tqdm

from fedbroker.config import DataSection
from fedbroker.datasets.dataset import Dataset
from fedbroker.datasets.image_files import (
    IMAGE_SUFFIXES,
    MASK_SUFFIX,
    MAX_FILES,
    MAX_TOTAL_VALUES,
    Bad,
    Header,
    check_image,
    count_files,
    decode,
    decode_mask,
    folder_images,
    header,
    inside,
    regular_file,
)
from fedbroker.datasets.labels import label_problems, width
from fedbroker.datasets.owned import MAX_CLASSES, class_indices, number
from fedbroker.datasets.stream import FileSamples
from fedbroker.datasets.tables import _Lines, _rows
from fedbroker.errors import ConfigError, ConfigErrors

log = logging.getLogger(__name__)

PROGRESS_FROM = 2_000  # files: a folder this large shows a progress bar (stderr) while its files are decoded
_SHOWN = 5             # files named per kind of problem; the rest are counted

PATH, CSV, MASKS = "worker.data.path", "worker.data.labels_csv", "worker.data.masks"


class _Problems:
    """Problems gathered over a whole folder, by (setting, kind): the first `_SHOWN` places of each and a count."""

    def __init__(self) -> None:
        self.places: dict[tuple[str, str], list[str]] = {}
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.errors: list[ConfigError] = []

    def add(self, setting: str, bad: Bad, place: str) -> None:
        key = (setting, bad.kind)
        self.counts[key] += 1
        shown = self.places.setdefault(key, [])
        if len(shown) < _SHOWN:
            shown.append(f"{place} ({bad.detail})" if bad.detail else place)

    def raise_any(self) -> None:
        errors = []
        for (setting, kind), shown in self.places.items():
            more = self.counts[(setting, kind)] - len(shown)
            errors.append(ConfigError(setting, f"{kind}: {'; '.join(shown)}" + (f" (and {more} more)" if more else "")))
        errors.extend(self.errors)  # the labels' own checks, after the files'
        if errors:
            raise errors[0] if len(errors) == 1 else ConfigErrors(errors)


@dataclass
class _Index:
    """The samples as the CSV (or the folder) lists them: relative names, the CSV line of each, label cells."""

    names: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    cells: list[tuple[str, ...]] = field(default_factory=list)
    label_names: list[str] = field(default_factory=list)

    def place(self, i: int, source: DataSection) -> str:
        return f"{source.labels_csv} line {self.lines[i]}: {self.names[i]!r}" if self.lines[i] else self.names[i]


def load_images(source: DataSection, *, most_files: int = MAX_FILES) -> Dataset:
    """The folder's samples and labels, every file checked and decoded once (module docstring)."""
    folder = source.path
    if not folder or not os.path.isdir(folder):
        raise ConfigError(PATH, f"dataset images needs a folder of images; {folder!r} is not a folder")
    if source.labels == "mask":
        if not source.masks or not os.path.isdir(source.masks):
            raise ConfigError(MASKS, f"labels mask needs the folder of masks; {source.masks!r} is not a folder")
        if not 2 <= source.num_classes <= MAX_CLASSES:
            raise ConfigError("worker.data.num_classes", f"is required with labels mask: the classes of a mask, in "
                                                         f"[2, {MAX_CLASSES}] (background included), got "
                                                         f"{source.num_classes}")
    index = _csv_index(source, most_files) if source.labels_csv else _folder_index(source, most_files)
    if not index.names:
        raise ConfigError(CSV if source.labels_csv else PATH, f"{source.labels_csv or folder} holds no samples")
    problems = _Problems()
    paths = _resolve(folder, index, source, problems, setting=PATH)
    masks = _resolve(source.masks, index, source, problems, setting=MASKS, images=paths) \
        if source.labels == "mask" else []
    y, num_classes = _labels(index, source, problems)
    heads = _headers(paths, problems)
    shape = _sample_shape(paths, heads, problems)
    _decode_all(paths, heads, masks, source, problems)
    problems.raise_any()
    x = FileSamples([str(p) for p in paths], _read_image, sample_shape=shape)
    if source.labels == "mask":
        y = cast(np.ndarray, FileSamples([str(m) for m in masks], _read_mask, sample_shape=shape[1:], dtype=np.int64))
    # FileSamples quacks like an array where a Dataset's users need it (fedbroker.datasets.stream)
    return Dataset(x=cast(np.ndarray, x), y=y, num_classes=num_classes, name="images", labels=source.labels)


def _folder_index(source: DataSection, most: int) -> _Index:
    if source.labels != "mask":
        raise ConfigError(CSV, f"labels {source.labels} need a labels CSV naming each file and its label (only a "
                               f"folder of images with masks needs none)")
    if count_files(source.path, most) > most:
        raise ConfigError(PATH, f"{source.path} holds more than {most} files (counted up to {most + 1}); split it "
                                f"between sites or name the samples in a labels CSV")
    names = folder_images(source.path)
    return _Index(names=names, lines=[0] * len(names), cells=[()] * len(names))


def _label_columns(source: DataSection) -> list[str]:
    if source.labels == "class":
        return [source.label_column]
    if source.labels == "mask":
        return []
    return list(source.label_columns) or [source.label_column]


def _csv_index(source: DataSection, most: int) -> _Index:
    """The CSV's file names and label cells; its header and each row's width are checked as they are read."""
    path = source.labels_csv
    try:
        with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as fh:
            lines = _Lines(fh, path)
            rows = _rows(csv.reader(lines), lines)
            first = next(rows, None)
            if first is None:
                raise ConfigError(CSV, f"{path} is empty: it needs a header row naming the columns")
            header_row = [name.strip() for name in first]
            wanted = [source.file_column, *_label_columns(source)]
            missing = [c for c in wanted if c not in header_row]
            if missing:
                setting = "worker.data.file_column" if source.file_column in missing else (
                    "worker.data.label_column" if source.labels == "class" else "worker.data.label_columns")
                raise ConfigError(setting, f"{path} has no column {', '.join(map(repr, missing))}; its columns: "
                                           f"{', '.join(map(repr, header_row[:20]))}")
            at = [header_row.index(c) for c in wanted]
            index = _Index(label_names=wanted[1:])
            for row in rows:
                if not any(cell.strip() for cell in row):
                    continue
                if len(row) != len(header_row):
                    raise ConfigError(CSV, f"{path} line {lines.number}: {len(row)} fields, the header has "
                                           f"{len(header_row)}")
                if len(index.names) == most:
                    raise ConfigError(CSV, f"{path} names more than {most} files; split them between sites")
                cells = [row[i].strip() for i in at]
                index.names.append(cells[0])
                index.lines.append(lines.number)
                index.cells.append(tuple(cells[1:]))
            return index
    except OSError as exc:
        raise ConfigError(CSV, f"{path} cannot be read: {exc.strerror}") from None


def _resolve(folder: str, index: _Index, source: DataSection, problems: _Problems, *, setting: str,
             images: list[str | None] | None = None) -> list[str | None]:
    """Each sample's file in `folder`, or None with the problem noted: a path leaving the folder, a missing or
    unreadable file, a file named twice. With `images` (their paths, None where refused) the masks of those
    images: the same relative name with MASK_SUFFIX, a refused image's row not examined again."""
    real, absolute = os.path.realpath(folder), os.path.abspath(folder)
    seen: dict[str, int] = {}
    out: list[str | None] = []
    for i, name in enumerate(index.names):
        if images is not None and images[i] is None:
            out.append(None)
            continue
        wanted = name if images is None else os.path.splitext(name)[0] + MASK_SUFFIX
        place = index.place(i, source) if images is None else f"{os.path.join(folder, wanted)} (for {name!r})"
        try:
            path, key = inside(real, wanted)
            if images is None and not name.lower().endswith(IMAGE_SUFFIXES):
                raise Bad(f"files without an image suffix ({', '.join(IMAGE_SUFFIXES)})")
            try:
                regular_file(path)
            except Bad as bad:
                if images is None or bad.kind != "missing files":
                    raise
                raise Bad(f"missing masks (an image's mask is its name with {MASK_SUFFIX} in the masks folder)") from None
            if key in seen:
                raise Bad("files named twice" if images is None else "masks paired with two images",
                          f"also {index.place(seen[key], source)}")
            seen[key] = i
            out.append(os.path.join(absolute, wanted))  # a sample's key: read the same whatever the cwd later
        except Bad as bad:
            problems.add(setting, bad, place)
            out.append(None)
    return out


def _labels(index: _Index, source: DataSection, problems: _Problems) -> tuple[np.ndarray, int]:
    """The labels of the CSV's rows, as the kind wants them; every problem noted, none raised."""
    n = len(index.names)
    if source.labels == "mask":
        return np.zeros(n, dtype=np.int64), source.num_classes
    csv_source = dataclasses.replace(source, path=source.labels_csv)
    if source.labels == "class":
        try:
            return class_indices([c[0] for c in index.cells], csv_source)
        except ConfigError as error:
            problems.errors.append(error)
            return np.zeros(n, dtype=np.int64), 1
    values = np.zeros((n, len(index.label_names)), dtype=np.float64)
    for i, cells in enumerate(index.cells):
        for j, cell in enumerate(cells):
            try:
                values[i, j] = number(cell, f"{source.labels_csv} line {index.lines[i]}, column "
                                            f"{index.label_names[j]!r}")
            except ConfigError as error:
                problems.add(CSV, Bad("label cells that are not finite numbers"), error.problem)
    y = values[:, 0] if source.labels == "target" and values.shape[1] == 1 else values

    def where(at: tuple[int, ...]) -> str:
        return f"{source.labels_csv} line {index.lines[at[0]]}, column {index.label_names[at[1] if len(at) > 1 else 0]!r}"

    problems.errors.extend(label_problems(source.labels, y, (n,), num_classes=source.num_classes, where=where))
    return np.ascontiguousarray(y, dtype=np.float32), width(source.labels, y)


def _headers(paths: list[str | None], problems: _Problems) -> list[Header | None]:
    """Each file's declared size and mode, before any pixel is decoded; the folder's total checked against
    `MAX_TOTAL_VALUES` before the decode pass starts."""
    heads: list[Header | None] = []
    total = 0
    for path in paths:
        head = None
        if path is not None:
            try:
                head = header(path)
                total += head.values
            except Bad as bad:
                problems.add(PATH, bad, path)
        heads.append(head)
    if total > MAX_TOTAL_VALUES:
        problems.raise_any()  # the files' own problems first, with the total
        raise ConfigError(PATH, f"the images declare {total} values in all (C·H·W summed), over the "
                                f"{MAX_TOTAL_VALUES} a site decodes at start; split them between sites")
    return heads


def _sample_shape(paths: list[str | None], heads: list[Header | None], problems: _Problems) -> tuple[int, int, int]:
    """(C, H, W), a size 0 where the files differ; files of different channel counts are refused by name."""
    known = [(p, h) for p, h in zip(paths, heads) if h is not None and p is not None]
    channels = collections.Counter(h.channels for _, h in known)
    if len(channels) > 1:
        common = channels.most_common(1)[0][0]
        for path, head in known:
            if head.channels != common:
                problems.add(PATH, Bad(f"images with {head.channels} channels among {channels[common]} with "
                                       f"{common} (save them alike: grey or RGB)"), path)
    heights = {h.height for _, h in known}
    widths = {h.width for _, h in known}
    return (channels.most_common(1)[0][0] if channels else 1, heights.pop() if len(heights) == 1 else 0,
            widths.pop() if len(widths) == 1 else 0)


def _decode_all(paths: list[str | None], heads: list[Header | None], masks: list[str | None], source: DataSection,
                problems: _Problems) -> None:
    """Every image (and mask) decoded once, one at a time, so memory stays one image's; a progress bar on stderr
    for a large folder."""
    todo = [i for i, h in enumerate(heads) if h is not None]
    with tqdm(total=len(todo), desc="checking images", unit="file", disable=len(todo) < PROGRESS_FROM,
              leave=False) as bar:
        for i in todo:
            path, head = str(paths[i]), heads[i]
            try:
                check_image(path)
            except Bad as bad:
                problems.add(PATH, bad, path)
            if masks and masks[i] is not None:
                _check_mask(str(masks[i]), head, source.num_classes, problems)  # type: ignore[arg-type]
            bar.update(1)


def _check_mask(path: str, image: Header, num_classes: int, problems: _Problems) -> None:
    try:
        head = header(path, mask=True)
        if (head.width, head.height) != (image.width, image.height):
            raise Bad("masks of another size than their image", f"{head.width}×{head.height}, the image is "
                                                                f"{image.width}×{image.height}")
        values = decode_mask(path)
    except Bad as bad:
        problems.add(MASKS, bad, path)
        return
    low, high = int(values.min()), int(values.max())
    if low >= 0 and high < num_classes:
        return
    hint = ""
    if high == 255 and set(np.unique(values).tolist()) <= {0, 255}:
        hint = "; a 0/255 mask: save class indices 0..num_classes−1 (divide by 255)"
    problems.add(MASKS, Bad(f"masks with values outside 0..{num_classes - 1} (worker.data.num_classes "
                            f"{num_classes}){hint}", f"{low}..{high}"), path)


def _reader(read: Callable[[str], np.ndarray], setting: str) -> Callable[[str], np.ndarray]:
    """`read`, for a batch mid-job. A file that fails now passed at start, so it changed since: the site's log
    names it, the error does not, for the error may leave the site as a task's failure reason and a file's
    name can be a patient's."""
    def read_one(path: str) -> np.ndarray:
        try:
            return read(path)
        except Bad as bad:
            log.error("%s changed since the worker started: %s%s", path, bad.kind, f" ({bad.detail})" * bool(bad.detail))
            raise ConfigError(setting, f"a file changed since the worker started ({bad.kind}); the site's log names "
                                       f"it") from None
    return read_one


_read_image = _reader(decode, PATH)
_read_mask = _reader(decode_mask, MASKS)
