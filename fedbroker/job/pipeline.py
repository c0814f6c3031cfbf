"""A job's preprocessing and augmentation, as data (the `preprocess`, `augment` and `expect` keys of its `data:`
section): a closed list of named transforms with typed, bounded arguments, so that no code travels with a job
and a site can check every step before it reads a file.

- `preprocess` runs on the site, in order, on every raw sample (training and evaluation alike) and is what the
  download's README tells a user to apply to a raw file: `window`, `resize`, `resize_volume`, `crop`, `pad`,
  `channels`, `normalize`.
- `augment` runs in training only, seeded, on prepared batches; a mask gets the same geometric transform as its
  image: `flip`, `rotate90`, `random_crop`, `intensity`. Every augmentation keeps the prepared shape.
- `expect` states the spacing and orientation a volume site's files must have (checked on the site).

A sample is (C, *spatial), 2-D or 3-D; a spatial size of 0 in a site's sample shape means its files differ
there, which a `resize`, `crop` or `pad` must fix. No torch here: `fedbroker.datasets.transforms` applies a
pipeline with MONAI.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.graph.checks import MAX_WIDTH, is_int, show

PREPROCESS = ("window", "resize", "resize_volume", "crop", "pad", "channels", "normalize")
AUGMENT = ("flip", "rotate90", "random_crop", "intensity")
SIZE_STEPS = ("resize", "resize_volume", "crop", "pad")   # steps that set the spatial sizes
FIELDS = ("preprocess", "augment", "expect")
MAX_STEPS = 32                 # per list: a pipeline is a few steps, never a program
MAX_SAMPLE_VALUES = 1 << 26    # one prepared sample: 64 Mi values (256 MiB as float32), e.g. 400^3 voxels
MAX_CHANNELS = 64
MAX_PAD = 1024                 # random_crop's padding, per side
MAX_INTENSITY = 10.0           # intensity jitter: scale and shift bounds
MAX_WINDOW = 1e7               # window centre and width, in the raw file's units (Hounsfield: |x| <= ~3000)
ORIENTATION_LETTERS = ("LR", "PA", "IS")   # one letter of each pair, in any order (nibabel's axis codes)


@dataclass(frozen=True)
class Step:
    """One transform: its name from the closed list and its checked arguments (see `_PARSERS`)."""

    name: str
    args: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The step as a job writes it."""
        a = self.args
        if self.name in SIZE_STEPS:
            return {self.name: list(a["size"])}
        if self.name == "channels":
            return {"channels": a["channels"]}
        if self.name == "normalize":
            return {"normalize": "per_image" if not a["mean"] else {"mean": list(a["mean"]), "std": list(a["std"])}}
        return {self.name: {k: list(v) if isinstance(v, tuple) else v for k, v in a.items()}}


@dataclass(frozen=True)
class Expect:
    """What a volume's header must say (checked on the site by the volume readers): voxel spacing in mm within a
    relative tolerance, and an orientation code such as RAS; empty: not checked."""

    spacing: tuple[float, ...] = ()
    spacing_tolerance: float = 0.05
    orientation: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The section as a job writes it (what is set)."""
        out: dict[str, Any] = {}
        if self.spacing:
            out["spacing"] = list(self.spacing)
            out["spacing_tolerance"] = self.spacing_tolerance
        if self.orientation:
            out["orientation"] = self.orientation
        return out


@dataclass(frozen=True)
class DataPipeline:
    """A job's preprocessing and augmentation, checked (build it with `parse_pipeline`)."""

    preprocess: tuple[Step, ...] = ()
    augment: tuple[Step, ...] = ()
    expect: Expect = field(default_factory=Expect)

    @property
    def spatial_rank(self) -> int:
        """2 or 3 where a step fixes it (a size list's length, or rotate/crop sizes); 0 when no step does."""
        for step in (*self.preprocess, *self.augment):
            if "size" in step.args:
                return len(step.args["size"])
        return 0   # `expect` says nothing of it: a volume's spacing is 3-D, and its slices are 2-D samples

    def to_dict(self) -> dict[str, Any]:
        """The pipeline as a job writes it (`parse_pipeline(p.to_dict()) == p`); empty lists are left out."""
        out: dict[str, Any] = {}
        if self.preprocess:
            out["preprocess"] = [s.to_dict() for s in self.preprocess]
        if self.augment:
            out["augment"] = [s.to_dict() for s in self.augment]
        if self.expect != Expect():
            out["expect"] = self.expect.to_dict()
        return out

    def to_json(self) -> str:
        """The one canonical text of the pipeline (how it travels in a job's settings)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """SHA-256 of the canonical text: the same pipeline, written in any key order, has one digest (a site's
        cache of prepared samples is keyed by it)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def output_shape(self, site_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape the model receives from a site whose raw samples have `site_shape` (C, *spatial; 0 = varies
        between files). Raises ConfigError(s) naming the step that cannot take them, or a size left varying."""
        shape, problems = self._walk(site_shape)
        if problems:
            raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
        return shape

    def shape_problems(self, site_shape: Sequence[int]) -> list[ConfigError]:
        """`output_shape`'s problems, as a list (empty when the samples fit)."""
        return self._walk(site_shape)[1]

    def _walk(self, site_shape: Sequence[int]) -> tuple[tuple[int, ...], list[ConfigError]]:
        shape = tuple(int(d) for d in site_shape)
        if len(shape) not in (3, 4):
            return shape, [ConfigError("data", f"preprocessing takes samples of shape (C, H, W) or (C, D, H, W); this "
                                               f"site's samples have shape {list(shape)}")]
        if shape[0] <= 0:
            return shape, [ConfigError("data", f"the number of channels must be the same in every file, got "
                                               f"{list(shape)}")]
        problems: list[ConfigError] = []
        for i, step in enumerate(self.preprocess):
            shape = _SHAPERS[step.name](step.args, shape, f"data.preprocess[{i}].{step.name}", problems)
        varying = [i for i, d in enumerate(shape) if d == 0]
        if varying and not problems:
            problems.append(ConfigError("data.preprocess", (
                f"the site's files differ in size along axes {varying} of {list(site_shape)} (0 = varies): add a "
                f"resize, crop or pad to give every sample one shape")))
        if not problems and math.prod(shape) > MAX_SAMPLE_VALUES:
            problems.append(ConfigError("data.preprocess", f"makes samples of shape {list(shape)}, "
                                                           f"{math.prod(shape):,} values; at most {MAX_SAMPLE_VALUES:,}"))
        if not problems:
            for i, step in enumerate(self.augment):
                _augment_fits(step, shape, f"data.augment[{i}].{step.name}", problems)
        return shape, problems

    def describe(self) -> list[str]:
        """What a raw file goes through, one plain sentence per step (the download's README)."""
        lines = ["Read the raw file as a float32 array of shape (channels, height, width), or (channels, depth, "
                 "height, width) for a volume; a grey image or a volume has one channel."]
        lines += [_describe(step) for step in self.preprocess]
        if self.augment:
            lines.append("In training only (never for evaluation or prediction), each batch was then augmented at "
                         "random, the same geometric change applied to an image and its mask:")
            lines += [_describe(step) for step in self.augment]
        if self.expect.spacing:
            lines.append(f"Volumes were required to have voxel spacing {_mm(self.expect.spacing)} mm (within "
                         f"{self.expect.spacing_tolerance:.0%}).")
        if self.expect.orientation:
            lines.append(f"Volumes were required to be in {self.expect.orientation} orientation.")
        return lines


def _mm(values: Sequence[float]) -> str:
    return " × ".join(f"{v:g}" for v in values)


def _describe(step: Step) -> str:
    a, name = step.args, step.name
    size = " × ".join(str(v) for v in a.get("size", ()))
    if name == "window":
        lo, hi = a["center"] - a["width"] / 2, a["center"] + a["width"] / 2
        return (f"Intensity window centre {a['center']:g}, width {a['width']:g}: values are clipped to "
                f"[{lo:g}, {hi:g}] and scaled linearly to [0, 1].")
    if name in ("resize", "resize_volume"):
        return (f"Resized to {size} (linear interpolation for images: bilinear in 2-D, trilinear in 3-D; "
                f"nearest neighbour for masks).")
    if name == "crop":
        return f"Cropped around the centre to {size} (zero-padded around the centre where a file is smaller)."
    if name == "pad":
        return f"Zero-padded around the centre to {size} (cropped around the centre where a file is larger)."
    if name == "channels":
        return f"The single grey channel repeated to {a['channels']} channels."
    if name == "normalize" and not a["mean"]:
        return "Normalised per image and channel: minus its mean, divided by its standard deviation."
    if name == "normalize":
        return f"Normalised per channel: minus mean {list(a['mean'])}, divided by std {list(a['std'])}."
    if name == "flip":
        return f"- flipped along sample axes {list(a['axes'])} (0 = channels), each with probability {a['p']:g};"
    if name == "rotate90":
        return f"- rotated by a random multiple of 90° in the plane of axes {list(a['axes'])}, with probability {a['p']:g};"
    if name == "random_crop":
        return (f"- zero-padded by {a['pad']} on each side, a random {size} window taken and resized back to the "
                f"prepared size;")
    return (f"- intensities multiplied by 1 + U(-{a['scale']:g}, {a['scale']:g}) and shifted by "
            f"U(-{a['shift']:g}, {a['shift']:g}), each with probability {a['p']:g}.")


# --- shapes --------------------------------------------------------------------------------------------------


def _rank_ok(size: Sequence[int], shape: tuple[int, ...], where: str, problems: list[ConfigError]) -> bool:
    if len(size) == len(shape) - 1:
        return True
    problems.append(ConfigError(where, f"has {len(size)} sizes ({len(size)}-D) but the samples here are "
                                       f"{len(shape) - 1}-D, shape {list(shape)}"))
    return False


def _resize(args: Mapping[str, Any], shape: tuple[int, ...], where: str, problems: list[ConfigError]) -> tuple[int, ...]:
    size = args["size"]
    return (shape[0], *size) if _rank_ok(size, shape, where, problems) else shape


def _crop_or_pad(args: Mapping[str, Any], shape: tuple[int, ...], where: str,
                 problems: list[ConfigError]) -> tuple[int, ...]:
    size = args["size"]
    if not _rank_ok(size, shape, where, problems):
        return shape
    crop = where.endswith(".crop")
    wrong = [(d, s) for d, s in zip(shape[1:], size, strict=True) if d and (d < s if crop else d > s)]
    if wrong:
        problems.append(ConfigError(where, (
            f"{list(size)} is {'larger' if crop else 'smaller'} than the samples' spatial size "
            f"{list(shape[1:])}: use {'pad' if crop else 'crop'} or resize")))
    return (shape[0], *size)


def _channels(args: Mapping[str, Any], shape: tuple[int, ...], where: str,
              problems: list[ConfigError]) -> tuple[int, ...]:
    n = args["channels"]
    if shape[0] not in (1, n):
        problems.append(ConfigError(where, f"repeats one grey channel; the samples here have {shape[0]} channels"))
    return (n, *shape[1:])


def _normalize(args: Mapping[str, Any], shape: tuple[int, ...], where: str,
               problems: list[ConfigError]) -> tuple[int, ...]:
    if len(args["mean"]) > 1 and len(args["mean"]) != shape[0]:
        problems.append(ConfigError(where, f"gives {len(args['mean'])} means and stds but the samples here have "
                                           f"{shape[0]} channels (give one, or one per channel)"))
    return shape


def _same(args: Mapping[str, Any], shape: tuple[int, ...], where: str, problems: list[ConfigError]) -> tuple[int, ...]:
    return shape


_Shaper = Callable[[Mapping[str, Any], tuple[int, ...], str, list[ConfigError]], tuple[int, ...]]
_SHAPERS: Mapping[str, _Shaper] = {"window": _same, "resize": _resize, "resize_volume": _resize,
                                   "crop": _crop_or_pad, "pad": _crop_or_pad, "channels": _channels,
                                   "normalize": _normalize}


def _augment_fits(step: Step, shape: tuple[int, ...], where: str, problems: list[ConfigError]) -> None:
    a, rank = step.args, len(shape) - 1
    axes = a.get("axes", ())
    if any(not 1 <= ax <= rank for ax in axes):
        problems.append(ConfigError(f"{where}.axes", f"must be spatial axes of the prepared sample "
                                                     f"{list(shape)}: 1 to {rank}, got {list(axes)}"))
    elif step.name == "rotate90" and shape[axes[0]] != shape[axes[1]]:
        problems.append(ConfigError(f"{where}.axes", f"rotating by 90° needs a square plane; axes {list(axes)} of "
                                                     f"the prepared sample {list(shape)} differ in size"))
    if step.name == "random_crop" and _rank_ok(a["size"], shape, f"{where}.size", problems):
        big = [s for s, d in zip(a["size"], shape[1:], strict=True) if s > d + 2 * a["pad"]]
        if big:
            problems.append(ConfigError(f"{where}.size", f"{list(a['size'])} is larger than the prepared size "
                                                         f"{list(shape[1:])} plus the padding {a['pad']} on each side"))


# --- parsing -------------------------------------------------------------------------------------------------


def _number(value: Any, where: str, problems: list[ConfigError], lo: float, hi: float, *,
            lo_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(float(value)) and (lo < value if lo_open else lo <= value) and value <= hi
    except OverflowError:
        ok = False
    if not ok:
        problems.append(ConfigError(where, f"must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}], "
                                           f"got {show(value)}"))
        return lo
    return float(value)


def _ints(value: Any, where: str, problems: list[ConfigError], lo: int, hi: int, lengths: Sequence[int]) -> tuple[int, ...]:
    if (isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) not in lengths
            or not all(is_int(v) and lo <= v <= hi for v in value)):
        counts = " or ".join(str(n) for n in lengths)
        problems.append(ConfigError(where, f"must be a list of {counts} integers in [{lo}, {hi}], got {show(value)}"))
        return ()
    return tuple(int(v) for v in value)


def _sizes(value: Any, where: str, problems: list[ConfigError], lengths: Sequence[int] = (2, 3)) -> tuple[int, ...]:
    size = _ints(value, where, problems, 1, MAX_WIDTH, lengths)
    if size and math.prod(size) > MAX_SAMPLE_VALUES:
        problems.append(ConfigError(where, f"{list(size)} makes {math.prod(size):,} values per channel, above the "
                                           f"limit of {MAX_SAMPLE_VALUES:,} per sample"))
        return ()
    return size


def _fields(raw: Any, where: str, problems: list[ConfigError], known: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        problems.append(ConfigError(where, f"must be a mapping with {', '.join(known)}, got {show(raw)}"))
        return {}
    problems.extend(ConfigError(f"{where}.{k}", f"unknown argument; known: {', '.join(known)}")
                    for k in raw if k not in known)
    return raw


def _p(raw: Mapping[str, Any], where: str, problems: list[ConfigError]) -> float:
    return _number(raw.get("p", 0.5), f"{where}.p", problems, 0.0, 1.0)


def _parse_window(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
    raw = _fields(raw, where, problems, ("center", "width"))
    missing = [k for k in ("center", "width") if k not in raw]
    if raw and missing:
        problems.append(ConfigError(where, f"needs {' and '.join(missing)}"))
    return {"center": _number(raw.get("center", 0), f"{where}.center", problems, -MAX_WINDOW, MAX_WINDOW),
            "width": _number(raw.get("width", 1), f"{where}.width", problems, 0.0, MAX_WINDOW, lo_open=True)}


def _parse_size(lengths: Sequence[int]) -> Callable[[Any, str, list[ConfigError], int], dict[str, Any]]:
    def parse(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
        return {"size": _sizes(raw, where, problems, lengths)}
    return parse


def _parse_channels(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
    if not (is_int(raw) and 1 <= raw <= MAX_CHANNELS):
        problems.append(ConfigError(where, f"must be an integer in [1, {MAX_CHANNELS}], got {show(raw)}"))
        return {"channels": 1}
    return {"channels": int(raw)}


def _parse_normalize(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
    if raw == "per_image":
        return {"mean": (), "std": ()}
    if not isinstance(raw, Mapping):
        problems.append(ConfigError(where, f"must be per_image or {{mean: [...], std: [...]}}, got {show(raw)}"))
        return {"mean": (), "std": ()}
    raw = _fields(raw, where, problems, ("mean", "std"))
    out: dict[str, tuple[float, ...]] = {}
    for key, lo in (("mean", -MAX_WINDOW), ("std", 0.0)):
        values = raw.get(key)
        if isinstance(values, (int, float)) and not isinstance(values, bool):
            values = [values]
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not 1 <= len(values) <= MAX_CHANNELS:
            problems.append(ConfigError(f"{where}.{key}", f"must be a number or a list of 1 to {MAX_CHANNELS} "
                                                          f"numbers, got {show(values)}"))
            out[key] = (1.0,)
            continue
        out[key] = tuple(_number(v, f"{where}.{key}[{j}]", problems, lo, MAX_WINDOW, lo_open=key == "std")
                         for j, v in enumerate(values))
    if len(out["mean"]) != len(out["std"]):
        problems.append(ConfigError(where, f"gives {len(out['mean'])} means but {len(out['std'])} stds"))
    return {"mean": out["mean"], "std": out["std"]}


def _parse_flip(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
    raw = _fields(raw, where, problems, ("axes", "p"))
    axes = _ints(raw.get("axes", [rank or 2]), f"{where}.axes", problems, 1, 3, (1, 2, 3))
    if len(set(axes)) != len(axes):
        problems.append(ConfigError(f"{where}.axes", f"names an axis twice: {list(axes)}"))
    return {"axes": axes, "p": _p(raw, where, problems)}


def _parse_rotate90(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
    raw = _fields(raw, where, problems, ("axes", "p"))
    last = rank or 2
    axes = _ints(raw.get("axes", [last - 1, last]), f"{where}.axes", problems, 1, 3, (2,))
    if axes and axes[0] == axes[1]:
        problems.append(ConfigError(f"{where}.axes", f"must be two different axes, got {list(axes)}"))
    return {"axes": axes or (1, 2), "p": _p(raw, where, problems)}


def _parse_random_crop(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
    raw = _fields(raw, where, problems, ("size", "pad"))
    if raw and "size" not in raw:
        problems.append(ConfigError(f"{where}.size", "is required"))
        return {"size": (), "pad": 0}
    pad = raw.get("pad", 0)
    if not (is_int(pad) and 0 <= pad <= MAX_PAD):
        problems.append(ConfigError(f"{where}.pad", f"must be an integer in [0, {MAX_PAD}], got {show(pad)}"))
        pad = 0
    return {"size": _sizes(raw.get("size"), f"{where}.size", problems), "pad": int(pad)}


def _parse_intensity(raw: Any, where: str, problems: list[ConfigError], rank: int) -> dict[str, Any]:
    raw = _fields(raw, where, problems, ("scale", "shift", "p"))
    scale = _number(raw.get("scale", 0.0), f"{where}.scale", problems, 0.0, MAX_INTENSITY)
    shift = _number(raw.get("shift", 0.0), f"{where}.shift", problems, 0.0, MAX_INTENSITY)
    if raw and not scale and not shift and "scale" not in raw and "shift" not in raw:
        problems.append(ConfigError(where, "needs scale or shift (or both)"))
    return {"scale": scale, "shift": shift, "p": _p(raw, where, problems)}


_Parser = Callable[[Any, str, list[ConfigError], int], dict[str, Any]]
_PARSERS: Mapping[str, _Parser] = {
    "window": _parse_window, "resize": _parse_size((2, 3)), "resize_volume": _parse_size((3,)),
    "crop": _parse_size((2, 3)), "pad": _parse_size((2, 3)), "channels": _parse_channels,
    "normalize": _parse_normalize, "flip": _parse_flip, "rotate90": _parse_rotate90,
    "random_crop": _parse_random_crop, "intensity": _parse_intensity,
}


def _steps(raw: Any, key: str, names: Sequence[str], problems: list[ConfigError], rank: int) -> tuple[Step, ...]:
    where = f"data.{key}"
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        problems.append(ConfigError(where, f"must be a list of steps such as {{{names[0]}: ...}}, got {show(raw)}"))
        return ()
    if len(raw) > MAX_STEPS:
        problems.append(ConfigError(where, f"has {len(raw):,} steps; at most {MAX_STEPS}"))
        return ()
    steps = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping) or len(item) != 1:
            problems.append(ConfigError(at, f"must be one step, a mapping {{name: arguments}} with name one of "
                                            f"{', '.join(names)}; got {show(item)}"))
            continue
        ((name, args),) = item.items()
        if name not in names:
            other = f" ({name} is an augment step)" if name in AUGMENT else (
                f" ({name} is a preprocess step)" if name in PREPROCESS else "")
            problems.append(ConfigError(f"{at}.{name}" if isinstance(name, str) else at,
                                        f"unknown {key} step{other}; known: {', '.join(names)}"))
            continue
        steps.append(Step(name, _PARSERS[name](args, f"{at}.{name}", problems, rank)))
    return tuple(steps)


def _parse_expect(raw: Any, problems: list[ConfigError]) -> Expect:
    where = "data.expect"
    if raw is None:
        return Expect()
    raw = _fields(raw, where, problems, ("spacing", "spacing_tolerance", "orientation"))
    spacing: tuple[float, ...] = ()
    if "spacing" in raw:
        values = raw["spacing"]
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != 3:
            problems.append(ConfigError(f"{where}.spacing", f"must be 3 numbers (mm per voxel), got {show(values)}"))
        else:
            spacing = tuple(_number(v, f"{where}.spacing[{j}]", problems, 0.0, 1e4, lo_open=True)
                            for j, v in enumerate(values))
    tolerance = _number(raw.get("spacing_tolerance", 0.05), f"{where}.spacing_tolerance", problems, 0.0, 1.0)
    if tolerance >= 1.0:   # a relative tolerance of 100 % or more accepts any spacing: a fraction, as the site reads it
        problems.append(ConfigError(f"{where}.spacing_tolerance", f"must be a fraction in [0, 1), got {show(tolerance)}"))
        tolerance = 0.05
    orientation = raw.get("orientation", "")
    if orientation != "" and not _orientation_ok(orientation):
        problems.append(ConfigError(f"{where}.orientation", f"must be 3 letters, one of each of L/R, P/A, I/S (as "
                                                            f"RAS or LPS), got {show(orientation)}"))
        orientation = ""
    return Expect(spacing=spacing, spacing_tolerance=tolerance, orientation=orientation)


def _orientation_ok(code: Any) -> bool:
    return (isinstance(code, str) and len(code) == 3
            and sorted(next((i for i, pair in enumerate(ORIENTATION_LETTERS) if c in pair), 9) for c in code)
            == [0, 1, 2])


def pipeline_problems(pipeline: DataPipeline) -> list[ConfigError]:
    """What the lists cannot see one step at a time: every size list of one pipeline is 2-D or every one 3-D.
    `expect.spacing` is the volume's (3 numbers) whether the site trains on volumes or on their 2-D slices."""
    ranks = {f"data.{key}[{i}].{s.name}" + (".size" if key == "augment" else ""): len(s.args["size"])
             for key, steps in (("preprocess", pipeline.preprocess), ("augment", pipeline.augment))
             for i, s in enumerate(steps) if s.args.get("size")}
    if len(set(ranks.values())) > 1:
        first = next(iter(ranks))
        return [ConfigError(where, f"is {rank}-D but {first} is {ranks[first]}-D: one pipeline is 2-D or 3-D")
                for where, rank in ranks.items() if rank != ranks[first]]
    return []


def parse_pipeline(raw: Any) -> DataPipeline:
    """The pipeline of a job's `data:` section (its `preprocess`, `augment` and `expect` keys; other keys are the
    section's own and are ignored here). Every problem is raised at once, each at its path
    (`data.preprocess[1].resize`)."""
    if raw is None:
        return DataPipeline()
    if not isinstance(raw, Mapping):
        raise ConfigError("data", f"must be a mapping, got {show(raw)}")
    problems: list[ConfigError] = []
    preprocess = _steps(raw.get("preprocess"), "preprocess", PREPROCESS, problems, 0)
    rank = DataPipeline(preprocess=preprocess).spatial_rank   # the default axes of flip and rotate90 follow it
    augment = _steps(raw.get("augment"), "augment", AUGMENT, problems, rank)
    expect = _parse_expect(raw.get("expect"), problems)
    pipeline = DataPipeline(preprocess=preprocess, augment=augment, expect=expect)
    problems.extend(pipeline_problems(pipeline))
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    return pipeline


def pipeline_from_json(text: str) -> DataPipeline:
    """The pipeline as a job's settings carry it (`DataPipeline.to_json`), checked again: a site never trusts the
    server's check. Empty text: no pipeline."""
    if not text:
        return DataPipeline()
    if len(text) > 64 * 1024:
        raise ConfigError("data", f"the pipeline's text is {len(text):,} characters; at most 65,536")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError("data", f"the pipeline is not JSON: {exc}") from None
    return parse_pipeline(raw)
