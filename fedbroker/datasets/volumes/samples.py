"""Volumes found by a reader turned into a data set: their labels (a CSV naming each volume, or masks), every
volume decoded once at start to find what only its data shows, then lazy `FileSamples` (a whole volume or
one plane a sample) that decode a batch when training asks for it."""

from __future__ import annotations

import csv
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np
from tqdm import tqdm

from fedbroker.config import DataSection
from fedbroker.datasets.dataset import Dataset
from fedbroker.datasets.labels import label_problems, width
from fedbroker.datasets.owned import MAX_CLASSES, number
from fedbroker.datasets.stream import FileSamples
from fedbroker.datasets.volumes.geometry import Geometry
from fedbroker.datasets.volumes.nifti import NiftiFile, nifti_volumes
from fedbroker.errors import ConfigError, ConfigErrors

SLICE_AXES = {"axial": 2, "coronal": 1, "sagittal": 0}   # the RAS axis a plane is cut across
AFFINE_TOLERANCE_MM = 1e-3     # an image's and its mask's voxel-to-world affines agree within this
MAX_CSV_BYTES = 1 << 26        # a labels CSV: one row a volume
_SHOWN = 5


class Volume(Protocol):
    """One volume a reader found: its geometry, and its voxels decoded on demand (float32, RAS)."""

    @property
    def name(self) -> str:
        """Its key: the file name (NIfTI) or the series folder's (DICOM)."""

    @property
    def path(self) -> str:
        """Where it is, for messages."""

    @property
    def geometry(self) -> Geometry:
        """Its shape, spacing and stored orientation."""

    @property
    def channels(self) -> int:
        """Channels of one voxel (1 but for a 4-D NIfTI)."""

    def decode(self) -> np.ndarray:
        """(C, X, Y, Z) float32 in RAS, checked finite; ValueError or ConfigError saying why it cannot."""

    def plane(self, axis: int, index: int) -> np.ndarray | None:
        """(C, a, b) at `index` across RAS `axis` without decoding the rest, or None where it cannot."""

    def world(self) -> np.ndarray:
        """Its voxel-to-world affine in RAS."""


class DecodedCache:
    """The volumes decoded last, kept while they fit `budget` bytes: the slices of a .gz or of a DICOM series
    are cut from one decode instead of one decode a slice. Shared by the threads that read batches."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._held: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, decode: Callable[[], np.ndarray]) -> np.ndarray:
        """The decoded volume `key`, decoding it (outside the lock) when it is not held."""
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return self._held[key]
        value = decode()
        with self._lock:
            self._held[key] = value
            while sum(v.nbytes for v in self._held.values()) > self.budget and len(self._held) > 1:
                self._held.popitem(last=False)
        return value


class VolumeSamples(FileSamples):
    """FileSamples that carry the geometry of every volume they were cut from, through every view (a split, a
    partition), so the worker can check them against a job's `data.expect`; with slices, `groups` says which
    volume each sample was cut from, so a split keeps a volume's slices on one side."""

    geometries: tuple[Geometry, ...] = ()
    volume_of: np.ndarray | None = None   # per key: the index of its volume (slices only)

    def __getitem__(self, idx: np.ndarray | slice | Sequence[int]) -> VolumeSamples:
        view = VolumeSamples(self.keys, self.read_one, sample_shape=self.sample_shape, dtype=self.dtype,
                             index=self.index[idx])
        view.geometries, view.volume_of = self.geometries, self.volume_of
        return view

    @property
    def groups(self) -> np.ndarray | None:
        """The volume each sample was cut from (slices), None when each sample is a whole volume."""
        return None if self.volume_of is None else self.volume_of[self.index]


def raise_all(problems: Sequence[ConfigError]) -> None:
    """Nothing when there is no problem, the one, or all of them at once."""
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(list(problems))


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def slice_axis(source: DataSection) -> int | None:
    """The RAS axis `worker.data.slices` cuts across, None for whole volumes."""
    if not source.slices:
        return None
    if source.slices not in SLICE_AXES:
        raise ConfigError("worker.data.slices", f"must be '' (whole volumes) or {' | '.join(SLICE_AXES)}, got "
                                                f"{source.slices!r}")
    return SLICE_AXES[source.slices]


def mask_files(source: DataSection, kind: str, volumes: Sequence[Volume]) -> tuple[dict[str, NiftiFile],
                                                                                    list[ConfigError]]:
    """Each volume's mask (a NIfTI of the same file name; a DICOM series' is named after its folder), checked
    against its image: one channel, the same RAS shape and voxel-to-world affine."""
    if not source.masks or not os.path.isdir(source.masks):
        return {}, [ConfigError("worker.data.masks", f"labels mask needs the folder of masks (worker.data.masks); "
                                                     f"{source.masks!r} is not a folder")]
    found, problems = nifti_volumes(source.masks, setting="worker.data.masks")
    by_name = {m.name: m for m in found}
    masks: dict[str, NiftiFile] = {}
    missing: list[str] = []
    for volume in volumes:
        names = (volume.name,) if kind == "nifti" else (f"{volume.name}.nii.gz", f"{volume.name}.nii")
        mask = next((by_name[n] for n in names if n in by_name), None)
        if mask is None:
            missing.append(volume.name)
            continue
        masks[volume.name] = mask
        problems += _misfit(volume, mask)
    if missing:
        problems.append(ConfigError("worker.data.masks", f"{source.masks} holds no mask for {_listed(missing)} "
                                                         f"(a mask has its image's file name"
                                                         f"{'' if kind == 'nifti' else ' + .nii.gz'})"))
    return masks, problems


def _misfit(image: Volume, mask: NiftiFile) -> list[ConfigError]:
    if mask.channels != 1 or mask.geometry.shape != image.geometry.shape:
        return [ConfigError("worker.data.masks", f"{mask.path} has shape {list(mask.geometry.shape)} with "
                                                 f"{mask.channels} channels, its image {image.path} "
                                                 f"{list(image.geometry.shape)}: a mask is one class index a voxel")]
    mine, theirs = mask.world(), image.world()
    if not np.allclose(mine, theirs, atol=AFFINE_TOLERANCE_MM, rtol=0):
        return [ConfigError("worker.data.masks", f"{mask.path} lies elsewhere in space than its image {image.path} "
                                                 f"(their voxel-to-world affines differ by up to "
                                                 f"{float(np.abs(mine - theirs).max()):.4g} mm)")]
    return []


def csv_labels(source: DataSection, names: Sequence[str]) -> tuple[np.ndarray, int, list[ConfigError]]:
    """Each volume's label from `worker.data.labels_csv` (a row a volume: `file_column` names it), as the
    kind wants it (class indices, multi-hot rows, targets), its class or label count, and every problem."""
    path = source.labels_csv
    empty = np.zeros(0, np.int64)
    if not path or not os.path.isfile(path):
        return empty, 0, [ConfigError("worker.data.labels_csv", f"{source.labels} labels of volumes need a CSV naming "
                                                                f"each one (worker.data.labels_csv); {path!r} is not "
                                                                f"a file")]
    if os.path.getsize(path) > MAX_CSV_BYTES:
        return empty, 0, [ConfigError("worker.data.labels_csv", f"{path} is larger than {MAX_CSV_BYTES} bytes")]
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            rows = [row for row in csv.reader(fh) if any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        return empty, 0, [ConfigError("worker.data.labels_csv", f"{path} cannot be read: {exc}")]
    header = [c.strip() for c in rows[0]] if rows else []
    wanted = [source.label_column] if source.labels == "class" else list(source.label_columns) or [source.label_column]
    absent = [c for c in (source.file_column, *wanted) if c not in header]
    if absent:
        return empty, 0, [ConfigError("worker.data.labels_csv", f"{path} has no column {_listed(absent)}; its "
                                                                f"columns: {_listed(header)}")]
    at_file, at_labels = header.index(source.file_column), [header.index(c) for c in wanted]
    by_file: dict[str, tuple[int, list[str]]] = {}
    problems: list[ConfigError] = []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            problems.append(ConfigError("worker.data.labels_csv", f"{path} line {line}: {len(row)} fields, the header "
                                                                  f"has {len(header)}"))
            continue
        name = row[at_file].strip()
        if name in by_file:
            problems.append(ConfigError("worker.data.labels_csv", f"{path} line {line} names {name!r} again (line "
                                                                  f"{by_file[name][0]})"))
        by_file[name] = (line, [row[i].strip() for i in at_labels])
    unlabelled = [n for n in names if n not in by_file]
    strangers = sorted(set(by_file) - set(names))
    if unlabelled:
        problems.append(ConfigError("worker.data.labels_csv", f"{path} has no row for {_listed(unlabelled)}"))
    if strangers:
        problems.append(ConfigError("worker.data.labels_csv", f"{path} names volumes that are not in "
                                                              f"{source.path}: {_listed(strangers)}"))
    if problems:
        return empty, 0, problems
    cells = [by_file[n] for n in names]
    if source.labels == "class":
        return _classes(source, [c[1][0] for c in cells], path)
    values = np.zeros((len(names), len(wanted)))
    for i, (line, row) in enumerate(cells):
        for j, cell in enumerate(row):
            try:
                values[i, j] = number(cell, f"{path} line {line}, column {wanted[j]!r}")
            except ConfigError as exc:
                problems.append(ConfigError("worker.data.labels_csv", exc.problem))
    y = values[:, 0] if source.labels == "target" and len(wanted) == 1 else values
    problems += label_problems(source.labels, y, (len(names), 1), num_classes=0,
                               where=lambda at: f"{path} line {cells[at[0]][0]}, column "
                                                f"{wanted[at[1] if len(at) > 1 else 0]!r}")
    return y.astype(np.float32), width(source.labels, y), problems


def _classes(source: DataSection, raw: list[str], path: str) -> tuple[np.ndarray, int, list[ConfigError]]:
    """Class indices from the CSV's labels: the declared `classes` in order, or whole numbers 0..K-1."""
    if source.classes:
        index = {c: i for i, c in enumerate(source.classes)}
        unknown = sorted({v for v in raw if v not in index})
        if unknown:
            return np.zeros(0, np.int64), 0, [ConfigError("worker.data.classes", f"{path} has labels {unknown[:5]} "
                                                          f"that are not among the declared classes "
                                                          f"{list(source.classes)}")]
        y = np.array([index[v] for v in raw], dtype=np.int64)
        count = len(source.classes)
    else:
        bad = sorted({v for v in raw if not (v.isdigit() and v.isascii())})
        if bad:
            return np.zeros(0, np.int64), 0, [ConfigError("worker.data.classes", f"{path}: labels {bad[:5]} are not "
                                                          f"class indices 0..K-1; list the label values in "
                                                          f"worker.data.classes")]
        y = np.array([int(v) for v in raw], dtype=np.int64)
        count = source.num_classes or int(y.max()) + 1
    if not 1 <= count <= MAX_CLASSES or int(y.max()) >= count:
        return y, count, [ConfigError("worker.data.num_classes", f"is {count} but {path}'s labels reach "
                                                                 f"{int(y.max())} (at most {MAX_CLASSES} classes)")]
    return y, count, []


def check_decoded(volumes: Sequence[Volume], masks: dict[str, NiftiFile], *, num_classes: int,
                  kind: str) -> list[ConfigError]:
    """Decode each volume (and its mask) once, one at a time, to find truncated data, NaN and infinite voxels,
    and mask values that are no class index: memory holds one volume at a time."""
    problems: list[ConfigError] = []
    for volume in tqdm(volumes, desc=f"checking {kind} volumes", unit="volume", leave=False,
                       disable=len(volumes) < 20):
        for item, setting in ((volume, "worker.data.path"), (masks.get(volume.name), "worker.data.masks")):
            if item is None:
                continue
            try:
                data = item.decode()
            except ConfigError as exc:
                problems.append(ConfigError(setting, exc.problem))
                continue
            except ValueError as exc:
                problems.append(ConfigError(setting, f"{item.path} {exc}"))
                continue
            if item is not volume:
                problems += [ConfigError(setting, f"{item.path}: {p.problem}") for p in label_problems(
                    "mask", data, (1, 1, *data.shape[1:]), num_classes=num_classes,
                    where=lambda at: f"voxel {list(at[1:])}")]
    return problems


def common_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """One sample's shape, 0 where the samples differ."""
    first = shapes[0]
    return tuple(d if all(s[i] == d for s in shapes) else 0 for i, d in enumerate(first))


def volume_dataset(source: DataSection, kind: str, volumes: Sequence[Volume],
                   problems: Sequence[ConfigError]) -> Dataset:
    """The checked volumes as lazy samples with their labels; every problem found (the readers' included)
    raised at once."""
    problems = list(problems)
    axis = slice_axis(source)
    masks: dict[str, NiftiFile] = {}
    labels, count = np.zeros(0, np.int64), source.num_classes
    if source.labels == "mask":
        if not 2 <= count <= MAX_CLASSES:
            problems.append(ConfigError("worker.data.num_classes", f"is required with labels mask: the classes of a "
                                                                   f"mask, in [2, {MAX_CLASSES}] (background "
                                                                   f"included), got {count}"))
        masks, more = mask_files(source, kind, volumes)
        problems += more
    else:
        labels, count, more = csv_labels(source, [v.name for v in volumes])
        problems += more
    problems += check_decoded(volumes, masks, num_classes=max(count, 1), kind=kind)
    if not volumes and not problems:
        problems.append(ConfigError("worker.data.path", f"{source.path} holds no volumes"))
    raise_all(problems)
    return _samples(source, kind, volumes, masks, labels, count, axis)


def _samples(source: DataSection, kind: str, volumes: Sequence[Volume], masks: dict[str, NiftiFile],
             labels: np.ndarray, count: int, axis: int | None) -> Dataset:
    """Keys are paths (the volume's file or series folder, then '#' and the plane's index with slices), as the
    stream's on-disk cache fingerprints a sample by its file's size and modification time."""
    cache = DecodedCache(source.memory_mib * 2**20 // 4)
    items: dict[str, Volume | NiftiFile] = {v.path: v for v in volumes}
    items.update({m.path: m for m in masks.values()})

    def cut(key: str) -> np.ndarray:
        if axis is None:
            return items[key].decode()
        path, _, at = key.rpartition("#")
        item, index = items[path], int(at)
        plane = item.plane(axis, index)
        return np.asarray(np.take(cache.get(path, item.decode), index, axis=1 + axis)) if plane is None else plane

    def mask(key: str) -> np.ndarray:
        return np.asarray(np.rint(cut(key)[0]), dtype=np.int64)

    def keyed(paths: Sequence[str]) -> list[str]:
        if axis is None:
            return list(paths)
        return [f"{p}#{k}" for p, v in zip(paths, volumes) for k in range(v.geometry.shape[axis])]

    if axis is None:
        spatial: list[tuple[int, ...]] = [v.geometry.shape for v in volumes]
        repeats = [1] * len(volumes)
    else:
        spatial = [tuple(d for i, d in enumerate(v.geometry.shape) if i != axis) for v in volumes]
        repeats = [v.geometry.shape[axis] for v in volumes]
    shape = common_shape([(v.channels, *s) for v, s in zip(volumes, spatial)])
    x = VolumeSamples(keyed([v.path for v in volumes]), cut, sample_shape=shape, dtype=np.float32)
    x.geometries = tuple(v.geometry for v in volumes)
    if axis is not None:
        x.volume_of = np.repeat(np.arange(len(volumes)), repeats)
    if source.labels == "mask":
        y: object = FileSamples(keyed([masks[v.name].path for v in volumes]), mask, sample_shape=shape[1:],
                                dtype=np.int64)
    else:
        y = np.repeat(labels, repeats, axis=0)
    # Dataset's fields are typed as arrays; FileSamples stands in for one (fedbroker.datasets.stream)
    return Dataset(x=cast(np.ndarray, x), y=cast(np.ndarray, y), num_classes=count, name=kind, labels=source.labels)
