"""One image file (PNG or JPEG, through Pillow), checked before it is trusted: its header's size and mode first,
then a full decode; and the folder it lies in, counted without listing it whole.

Every refusal is a `Bad(kind, detail)`: the reader (`fedbroker.datasets.images`) gathers them by kind over the
whole folder and names every file at once. Decoded pixels are float32 (C, H, W) in [0, 1]:

- `1` (bilevel) and `L` (8-bit grey): one channel, /255; `I;16` (16-bit grey, as X-rays are stored): one
  channel, /65535; `I` (32-bit grey, as some writers store 16-bit data): one channel, /65535, refused at start
  when a value lies outside 0..65535;
- `RGB`: three channels, /255 (a 48-bit PNG is read by Pillow as 8-bit RGB); `P` (palette): its colours, RGB;
- `LA`, `RGBA`, `PA` and a palette with a transparent colour: the alpha channel must be opaque everywhere (checked
  at start) and is dropped; a transparent pixel is refused, what lies behind it is not defined;
- any other mode (`CMYK`, `YCbCr`, `LAB`, `HSV`, `F`, signed 16-bit...) is refused: converting without the
  file's colour profile would train on colours the scanner never saw; save the files as grey or RGB.

Masks: one channel of class indices (`1`, `L`, `P`: its indices, not its colours, `I;16`, `I`), int64 (H, W).
"""

from __future__ import annotations

import os
import re
import stat
import struct
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
MASK_SUFFIX = ".png"
MAX_FILES = 1_000_000      # files a folder (or rows a labels CSV) may hold; a folder is counted up to MAX_FILES + 1
MAX_SIDE = 32_768          # pixels along one side of an image, as its header declares
MAX_PIXELS = 2**26         # pixels one image may declare (67 M: 8192 × 8192); under Pillow's own bomb limit (89 M)
MAX_TOTAL_VALUES = 2**37   # decoded values (C·H·W) a folder may declare in all: 137 G (ChestX-ray14's 112,120
                           # X-rays at 1024 × 1024 hold 118 G); bounds the decode at start, not the memory

_GREY = {"1": 255.0, "L": 255.0, "LA": 255.0, "I;16": 65535.0, "I;16L": 65535.0, "I;16B": 65535.0, "I": 65535.0}
_COLOUR = {"RGB", "RGBA", "P", "PA"}
_ALPHA = {"LA", "RGBA", "PA"}
_MASK_MODES = {"1", "L", "P", "I;16", "I;16L", "I;16B", "I"}
_DRIVE = re.compile(r"[A-Za-z]:[\\/]")  # C:\ or C:/ : an absolute Windows path in a CSV written there
_BROKEN = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError)


class Bad(Exception):
    """Why one file is refused: `kind` groups files alike in the refusal, `detail` is this file's own."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(kind, detail)
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Header:
    """What a file's header declares, read before any pixel is decoded."""

    width: int
    height: int
    mode: str

    @property
    def channels(self) -> int:
        """The channels of the decoded sample: 1 for grey modes, 3 for colour ones."""
        return 1 if self.mode in _GREY else 3

    @property
    def values(self) -> int:
        """C·H·W of the decoded sample."""
        return self.channels * self.width * self.height


def count_files(folder: str, most: int) -> int:
    """Entries directly in `folder`, counted with `os.scandir` and stopping at `most` + 1: a folder of millions is
    refused without listing it whole."""
    seen = 0
    with os.scandir(folder) as entries:
        for _ in entries:
            seen += 1
            if seen > most:
                break
    return seen


def folder_images(folder: str) -> list[str]:
    """The image files directly in `folder` (by suffix), sorted by name: the samples of a folder without a labels
    CSV. The caller counted the folder first (`count_files`)."""
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.name.lower().endswith(IMAGE_SUFFIXES) and not e.name.startswith("."))


def inside(folder_real: str, relative: str) -> tuple[str, str]:
    """The path of `relative` (a labels CSV's cell) within the folder whose real path is `folder_real`, and its
    real path; or `Bad`: an absolute path, a `..` step, or a link whose target lies outside the folder never reads
    a file beyond it."""
    if not relative:
        raise Bad("an empty file name")
    if "\x00" in relative:
        raise Bad("a file name holding a NUL byte")
    if os.path.isabs(relative) or relative.startswith(("/", "\\")) or _DRIVE.match(relative):
        raise Bad("an absolute path (file names are relative to worker.data.path)")
    if ".." in relative.replace("\\", "/").split("/"):
        raise Bad("a path leaving the folder ('..')")
    path = os.path.join(folder_real, relative)
    real = os.path.realpath(path)
    if os.path.commonpath([real, folder_real]) != folder_real:
        raise Bad("a link leading out of the folder", f"to {real}")
    return path, real


def regular_file(path: str) -> None:
    """`Bad` unless `path` is a regular file this process may read (a FIFO would hang the first read)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise Bad("missing files") from None
    except OSError as exc:
        raise Bad("unreadable files", exc.strerror or str(exc)) from None
    if not stat.S_ISREG(info.st_mode):
        raise Bad("not regular files (a folder, a device or a pipe)")
    if not os.access(path, os.R_OK):
        raise Bad("unreadable files", "permission denied")


@contextmanager
def _opened(path: str) -> Iterator[Image.Image]:
    """The file opened by Pillow as PNG or JPEG (headers only), every failure turned into `Bad`; Pillow's
    decompression-bomb warning is an error here, never a line in a log."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(path, formats=("PNG", "JPEG")) as image:
                yield image
        except Bad:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise Bad("decompression bombs (the header declares more pixels than Pillow allows)", str(exc)) from None
        except UnidentifiedImageError:
            raise Bad("not PNG or JPEG images") from None
        except FileNotFoundError:
            raise Bad("missing files") from None
        except PermissionError:
            raise Bad("unreadable files", "permission denied") from None
        except _BROKEN as exc:
            raise Bad("truncated or corrupt images (they cannot be decoded)", str(exc) or type(exc).__name__) from None


def _checked_header(image: Image.Image, *, mask: bool) -> Header:
    width, height = image.size
    header = Header(width, height, image.mode)
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise Bad(f"absurd dimensions (a side beyond 1..{MAX_SIDE})", f"{width}×{height}")
    if width * height > MAX_PIXELS:
        raise Bad(f"images over {MAX_PIXELS} pixels", f"{width}×{height}")
    if mask and image.mode not in _MASK_MODES:
        raise Bad("masks that are not one channel of class indices (modes 1, L, P, I;16, I)", image.mode)
    if not mask and image.mode not in _GREY and image.mode not in _COLOUR:
        raise Bad("images in a mode that is not grey or RGB (save them as grey or RGB)", image.mode)
    return header


def header(path: str, *, mask: bool = False) -> Header:
    """The size and mode the file declares, checked against the limits before anything is decoded."""
    with _opened(path) as image:
        return _checked_header(image, mask=mask)


def _grey_or_colour(image: Image.Image) -> tuple[np.ndarray, np.ndarray | None]:
    """The decoded pixels (H, W) or (H, W, 3) and the alpha channel if the file has one."""
    mode = image.mode
    if mode == "P":
        mode = "PA" if "transparency" in image.info else "RGB"
        image = image.convert("RGBA" if mode == "PA" else "RGB")
    elif mode == "PA":
        image = image.convert("RGBA")
    elif mode == "1":
        image = image.convert("L")
    values = np.asarray(image)
    if mode in _ALPHA or image.mode == "RGBA":
        return values[..., :-1].squeeze(-1) if values.shape[-1] == 2 else values[..., :3], values[..., -1]
    return values, None


def check_image(path: str) -> Header:
    """The file decoded once, whole (a truncated or corrupt file fails here, at start), and checked: no transparent
    pixel, no 32-bit grey value beyond 16 bits. Nothing is kept: memory stays one image's."""
    with _opened(path) as image:
        head = _checked_header(image, mask=False)
        image.load()
        if head.mode not in _ALPHA and head.mode != "I" and "transparency" not in image.info:
            return head  # decoded whole; nothing in its values to check
        values, alpha = _grey_or_colour(image)
        if alpha is not None and int(alpha.min()) < 255:
            raise Bad("images with transparent pixels (alpha below 255; flatten them)")
        if head.mode == "I" and (int(values.min()) < 0 or int(values.max()) > 65535):
            raise Bad("32-bit grey images with values beyond 0..65535", f"{int(values.min())}..{int(values.max())}")
    return head


def decode(path: str) -> np.ndarray:
    """One image as float32 (C, H, W) in [0, 1] (the module's docstring says how each mode reads)."""
    with _opened(path) as image:
        head = _checked_header(image, mask=False)
        image.load()
        values, _ = _grey_or_colour(image)
    pixels = np.asarray(values, dtype=np.float32) / np.float32(_GREY.get(head.mode, 255.0))
    out: np.ndarray = np.clip(pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1), 0.0, 1.0)
    return out


def decode_mask(path: str) -> np.ndarray:
    """One mask as int64 (H, W): the class index of each pixel (a palette mask's indices, not its colours)."""
    with _opened(path) as image:
        _checked_header(image, mask=True)
        image.load()
        return np.asarray(image).astype(np.int64)
