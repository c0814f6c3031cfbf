"""Write the segmentation example's data: SYNTHETIC CT-like NIfTI volumes in Hounsfield units with lesion masks,
for three sites. No patient's scan, nothing downloaded.

    .venv/bin/python examples/segmentation-nifti/make_data.py [--out DIR] [--per-site N] [--size S] [--depth D]

The recipe (every number is this script's; the seed fixes every draw):

- A volume of X×Y×Z voxels, X and Y each drawn in [S-4, S+4] (S = 48 by default; the files differ in size, so
  the job's `resize` is needed) and Z in [D-2, D+2] axial slices (D = 12). Voxels of 1.0 × 1.0 × 2.5 mm, the
  affine diagonal, so the axes are RAS+ (x increasing towards the patient's right, y towards anterior, z
  towards superior; nibabel's axis codes R, A, S): `slices: axial` cuts along z.
- Stored as int16 Hounsfield units: air -1000 outside an elliptical body; soft tissue 40 HU; an organ (an
  ellipsoid filling much of the body, 60 HU); Gaussian noise of the site's sd; the site's scanner offset.
- Lesions: hypodense ellipsoids at 0 HU inside the organ (in-plane radius drawn from the site's range, 1-3
  slices of half-height), each written as 1 in the mask; everything else 0. A volume holds 0 to 3 lesions.

  | site | volumes | lesions per volume | in-plane radius (voxels) | noise sd (HU) | offset (HU) |
  |---|---|---|---|---|---|
  | site-a | N | 1-3 | 2-4 (small) | 15 | 0 |
  | site-b | N | 0-2 | 4-7 (large) | 15 | 0 |
  | site-c | N | 0-3 | 2-7 (mixed) | 25 | +15 |

Layout: `<out>/site-a/volumes/case-000.nii.gz` and `<out>/site-a/masks/case-000.nii.gz` (the mask has the
volume's file name, shape and affine; uint8), likewise site-b and site-c.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nibabel as nib
import numpy as np

SPACING = (1.0, 1.0, 2.5)
SITES = {  # lesions per volume (lo, hi), in-plane radius (lo, hi), noise sd, offset
    "site-a": ((1, 3), (2.0, 4.0), 15.0, 0.0),
    "site-b": ((0, 2), (4.0, 7.0), 15.0, 0.0),
    "site-c": ((0, 3), (2.0, 7.0), 25.0, 15.0),
}


def ellipsoid(shape: tuple[int, int, int], centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """The voxels inside the ellipsoid centred at `centre` with `radii`, both in voxels."""
    grid = np.ogrid[tuple(slice(0, n) for n in shape)]
    return sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii)) <= 1.0


def volume(rng: np.random.Generator, size: int, depth: int, site: str) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic CT volume (int16 HU) and its lesion mask (uint8), by the recipe in the docstring."""
    (lo, hi), (r_lo, r_hi), sd, offset = SITES[site]
    shape = (int(rng.integers(size - 4, size + 5)), int(rng.integers(size - 4, size + 5)),
             int(rng.integers(depth - 2, depth + 3)))
    centre = np.array(shape) / 2 + np.r_[rng.normal(0, 1.5, 2), 0]
    hu = np.full(shape, -1000.0)
    body = ellipsoid(shape, centre, np.array([0.45 * shape[0], 0.38 * shape[1], 10.0 * shape[2]]))
    hu[body] = 40.0
    organ_centre = centre + np.r_[rng.normal(0, 1.5, 2), 0]
    organ = ellipsoid(shape, organ_centre, np.array([0.30 * shape[0], 0.24 * shape[1], 0.7 * shape[2]])) & body
    hu[organ] = 60.0
    mask = np.zeros(shape, dtype=np.uint8)
    inside = np.argwhere(organ)
    for _ in range(int(rng.integers(lo, hi + 1))):
        at = inside[int(rng.integers(len(inside)))]
        r = rng.uniform(r_lo, r_hi)
        lesion = ellipsoid(shape, at, np.array([r, r * rng.uniform(0.8, 1.2), rng.uniform(1.0, 3.0)])) & organ
        hu[lesion] = 0.0
        mask[lesion] = 1
    hu[body] += rng.normal(0, sd, int(body.sum())) + offset
    return np.clip(np.rint(hu), -1024, 3071).astype(np.int16), mask


def save(path: Path, array: np.ndarray) -> None:
    image = nib.Nifti1Image(array, np.diag([*SPACING, 1.0]))
    image.header.set_xyzt_units("mm")
    nib.save(image, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--per-site", type=int, default=10, help="volumes per site")
    parser.add_argument("--size", type=int, default=48, help="the in-plane size before each file's is drawn")
    parser.add_argument("--depth", type=int, default=12, help="the axial slices before each file's are drawn")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    lesion_voxels = 0
    for k, site in enumerate(SITES):
        rng = np.random.default_rng([args.seed, k])
        for folder in ("volumes", "masks"):
            (out / site / folder).mkdir(parents=True, exist_ok=True)
        for i in range(args.per_site):
            hu, mask = volume(rng, args.size, args.depth, site)
            save(out / site / "volumes" / f"case-{i:03d}.nii.gz", hu)
            save(out / site / "masks" / f"case-{i:03d}.nii.gz", mask)
            lesion_voxels += int(mask.sum())
    print(f"wrote {args.per_site} synthetic CT volumes and masks per site for {', '.join(SITES)} to {out} "
          f"({lesion_voxels} lesion voxels in all)")


if __name__ == "__main__":
    main()
