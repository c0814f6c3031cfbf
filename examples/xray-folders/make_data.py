"""Write the X-ray example's data: SYNTHETIC chest-X-ray-like grey PNGs with a findings table, for three sites,
and a disjoint synthetic pretext set for the backbone's pretraining. No patient's image, nothing downloaded.

    .venv/bin/python examples/xray-folders/make_data.py [--out DIR] [--per-site N] [--pretext N] [--size S]

The recipe (every number below is this script's; the seed fixes every draw):

- A frontal "chest" on an S×S canvas (S = 64 by default), then cropped or padded to a width and a height drawn
  independently in [S-6, S+6], so the files' sizes differ a little and the job's `resize` is needed.
- Grey levels in [0, 1]: air 0.08 outside the body; an elliptical body 0.55; two lung fields 0.22 (ellipses
  left and right of the midline); the heart an ellipse 0.62 in the lower middle, 0.26·S wide; the spine a
  vertical band 0.7. Gaussian noise (sd 0.03) and a blur of radius 0.6 px, then a site's exposure (a gain
  and an offset of its own).
- Findings, each an independent yes/no per image at the site's prevalence (the `findings.csv` columns):
  - `effusion`: fluid in the base of one lung, the lower 25-40 % of the lung ellipse filled at 0.58 under a
    flat top;
  - `nodule`: one bright disc (0.8) of radius 0.035-0.06·S somewhere inside a lung field;
  - `cardiomegaly`: the heart drawn 0.40·S wide instead of 0.26·S.
- Sites differ in prevalence and in how the files are stored:

  | site | effusion | nodule | cardiomegaly | PNG |
  |---|---|---|---|---|
  | site-a | 0.30 | 0.20 | 0.15 | 8-bit grey (L) |
  | site-b | 0.15 | 0.35 | 0.25 | 16-bit grey (I;16), exposure gain 1.15 |
  | site-c | 0.25 | 0.15 | 0.40 | 8-bit grey (L), exposure offset +0.05 |

- `pretext/`: images of the same anatomy drawn from another seed, each with exactly one of four structures
  (0 none, 1 a bright disc anywhere in the chest, 2 a bright band across the lower chest, 3 a wide central
  ellipse), labelled 0-3 in `pretext/labels.csv`. `pretrain.py` trains the backbone on them: a pretext task,
  disjoint from every site's images, standing in for the public data a real backbone is pretrained on.

Layout: `<out>/site-a/images/*.png` and `<out>/site-a/findings.csv` (columns `file, patient_id, effusion,
nodule, cardiomegaly`; `patient_id` is never read), likewise site-b and site-c; `<out>/pretext/images/*.png`
and `<out>/pretext/labels.csv` (`file, structure`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

FINDINGS = ("effusion", "nodule", "cardiomegaly")
SITES = {  # prevalence of each finding, PNG bit depth, exposure (gain, offset)
    "site-a": ((0.30, 0.20, 0.15), 8, (1.0, 0.0)),
    "site-b": ((0.15, 0.35, 0.25), 16, (1.15, 0.0)),
    "site-c": ((0.25, 0.15, 0.40), 8, (1.0, 0.05)),
}


def ellipse(size: int, cy: float, cx: float, ry: float, rx: float) -> np.ndarray:
    """The pixels of an S×S canvas inside the ellipse centred (cy, cx) with radii (ry, rx), in pixels."""
    yy, xx = np.mgrid[0:size, 0:size]
    return ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0


def chest(rng: np.random.Generator, size: int, *, effusion: bool = False, nodule: bool = False,
          cardiomegaly: bool = False, band: bool = False, disc: bool = False) -> np.ndarray:
    """One synthetic frontal chest as grey levels in [0, 1] (the recipe in the module's docstring)."""
    s = float(size)
    img = np.full((size, size), 0.08)
    jitter = rng.normal(0, 0.015 * s, 4)
    img[ellipse(size, 0.52 * s + jitter[0], 0.5 * s + jitter[1], 0.46 * s, 0.42 * s)] = 0.55
    lungs = []
    for side in (-1, 1):
        lung = ellipse(size, 0.45 * s + jitter[2], 0.5 * s + side * 0.19 * s + jitter[3], 0.27 * s, 0.13 * s)
        img[lung] = 0.22
        lungs.append(lung)
    img[:, int(0.47 * s):int(0.53 * s)] = np.where(img[:, int(0.47 * s):int(0.53 * s)] > 0.1, 0.7, 0.08)
    heart_rx = (0.20 if cardiomegaly else 0.13) * s
    img[ellipse(size, 0.62 * s + jitter[0], 0.54 * s, 0.13 * s, heart_rx)] = 0.62
    if effusion:
        lung = lungs[int(rng.integers(2))]
        rows = np.flatnonzero(lung.any(axis=1))
        top = rows[-1] - int(rng.uniform(0.25, 0.40) * len(rows))
        fluid = lung.copy()
        fluid[:top] = False
        img[fluid] = 0.58
    if nodule:
        ys, xs = np.nonzero(lungs[0] | lungs[1])
        at = int(rng.integers(len(ys)))
        img[ellipse(size, ys[at], xs[at], *(2 * [rng.uniform(0.035, 0.06) * s]))] = 0.8
    if disc:  # pretext structure 1: a bright disc anywhere in the chest
        cy, cx = rng.uniform(0.2, 0.8, 2) * s
        img[ellipse(size, cy, cx, *(2 * [rng.uniform(0.04, 0.08) * s]))] = 0.8
    if band:  # pretext structure 2: a bright band across the lower chest
        top = int(rng.uniform(0.62, 0.75) * s)
        img[top:top + int(0.1 * s), int(0.15 * s):int(0.85 * s)] = 0.6
    img = img + rng.normal(0, 0.03, img.shape)
    blurred = Image.fromarray(np.clip(img * 255, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(0.6))
    return np.asarray(blurred, dtype=np.float64) / 255.0


def crop_or_pad(rng: np.random.Generator, img: np.ndarray, size: int) -> np.ndarray:
    """The canvas cut or padded (with air) to a height and a width each drawn in [size-6, size+6]."""
    h, w = (int(v) for v in rng.integers(size - 6, size + 7, 2))
    out = np.full((max(h, size), max(w, size)), 0.08)
    out[:size, :size] = img
    oy, ox = (max(0, (size - h) // 2), max(0, (size - w) // 2))
    return out[oy:oy + h, ox:ox + w]


def save_png(path: Path, img: np.ndarray, bits: int) -> None:
    """Grey levels in [0, 1] as an 8-bit (L) or 16-bit (I;16) grey PNG."""
    top = 255 if bits == 8 else 65535
    values = np.clip(np.rint(img * top), 0, top)
    Image.fromarray(values.astype(np.uint8 if bits == 8 else np.uint16)).save(path)  # mode L or I;16


def write_site(out: Path, name: str, n: int, size: int, rng: np.random.Generator) -> None:
    prevalence, bits, (gain, offset) = SITES[name]
    (out / name / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        has = rng.random(3) < np.asarray(prevalence)
        img = chest(rng, size, effusion=bool(has[0]), nodule=bool(has[1]), cardiomegaly=bool(has[2]))
        img = crop_or_pad(rng, np.clip(img * gain + offset, 0, 1), size)
        file = f"{name}-{i:05d}.png"
        save_png(out / name / "images" / file, img, bits)
        rows.append([file, f"{name}-p{rng.integers(10**6):06d}", *(int(v) for v in has)])
    with (out / name / "findings.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([["file", "patient_id", *FINDINGS], *rows])


def write_pretext(out: Path, n: int, size: int, rng: np.random.Generator) -> None:
    (out / "pretext" / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        structure = i % 4
        img = chest(rng, size, disc=structure == 1, band=structure == 2, cardiomegaly=structure == 3)
        file = f"pretext-{i:05d}.png"
        save_png(out / "pretext" / "images" / file, crop_or_pad(rng, img, size), 8)
        rows.append([file, structure])
    with (out / "pretext" / "labels.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([["file", "structure"], *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--per-site", type=int, default=300, help="images per site")
    parser.add_argument("--pretext", type=int, default=800, help="images of the pretext set")
    parser.add_argument("--size", type=int, default=64, help="the canvas before each file's size is drawn")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    for k, name in enumerate(SITES):
        write_site(out, name, args.per_site, args.size, np.random.default_rng([args.seed, k]))
    write_pretext(out, args.pretext, args.size, np.random.default_rng([args.seed, 99]))
    print(f"wrote {args.per_site} synthetic chest images per site for {', '.join(SITES)} and {args.pretext} "
          f"pretext images to {out}")


if __name__ == "__main__":
    main()
