"""A synthetic lesion-segmentation set (CT-like 2-D slices), the stand-in for the NAFI paper's segmentation set.

No medical segmentation set ships inside a wheel on the registries reachable here (the packages that offer
one, MedMNIST's and `amid`'s, download at run time), and the paper's own CIMC set (Carvana car masks) is not
reachable, so every table that uses this set calls it "synthetic".

Recipe (one slice, `size`×`size`, values ≈ [0, 1] before the site's scanner shift):
- background 0; a body ellipse (centre jittered ±10 %, semi-axes 0.36–0.46 and 0.30–0.40 of the size) at 0.35;
- two organs inside the body, ellipses with semi-axes 0.10–0.18 of the size, at 0.55 and 0.25;
- 0–3 lesions (0 with probability 0.2, else 1–3 uniformly), each a round blob inside the body with radius drawn
  from the site's lesion-radius range (pixels) and an intensity offset of ± `contrast` (sign at random: hypo- or
  hyper-dense) relative to the tissue under it; the lesion pixels are the mask (class 1), everything else 0;
- a Gaussian blur of 0.8 px (the scanner's point spread), then Gaussian noise σ = 0.06;
- the site's scanner: x ← gain·x + offset.

Heterogeneity across sites (`site_styles`): each site draws its gain from U(0.7, 1.3), its offset from
U(−0.15, 0.15), its lesion contrast from U(0.12, 0.35) and its lesion-radius range from a small- (1.5–3 px),
medium- (2.5–5 px) or large-lesion (4–7 px) regime (at 32×32; scaled with the size), so sites differ in
intensity, in contrast and in lesion size. The test set draws a fresh style per slice from the same
distributions (the population the federation serves).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.ndimage import gaussian_filter

RADIUS_REGIMES = ((1.5, 3.0), (2.5, 5.0), (4.0, 7.0))  # lesion radius in pixels at 32×32


@dataclass(frozen=True)
class SiteStyle:
    """One site's scanner and case mix."""

    gain: float
    offset: float
    contrast: float
    radius: tuple[float, float]


def draw_style(rng: np.random.Generator, size: int) -> SiteStyle:
    """A site's style drawn from the recipe's distributions."""
    lo, hi = RADIUS_REGIMES[int(rng.integers(len(RADIUS_REGIMES)))]
    scale = size / 32.0
    return SiteStyle(gain=float(rng.uniform(0.7, 1.3)), offset=float(rng.uniform(-0.15, 0.15)),
                     contrast=float(rng.uniform(0.12, 0.35)), radius=(lo * scale, hi * scale))


def site_styles(n_sites: int, size: int, rng: np.random.Generator) -> list[SiteStyle]:
    """One style per site."""
    return [draw_style(rng, size) for _ in range(n_sites)]


def _ellipse(yy: np.ndarray, xx: np.ndarray, cy: float, cx: float, ry: float, rx: float) -> np.ndarray:
    return np.asarray(((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0)


def one_slice(rng: np.random.Generator, size: int, style: SiteStyle) -> tuple[np.ndarray, np.ndarray]:
    """(image (size, size) float32, mask (size, size) int64) by the recipe."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    c = size / 2.0
    cy, cx = c + rng.uniform(-0.1, 0.1) * size, c + rng.uniform(-0.1, 0.1) * size
    ry, rx = rng.uniform(0.36, 0.46) * size, rng.uniform(0.30, 0.40) * size
    body = _ellipse(yy, xx, cy, cx, ry, rx)
    img = np.where(body, 0.35, 0.0)
    for level in (0.55, 0.25):
        oy, ox = cy + rng.uniform(-0.4, 0.4) * ry, cx + rng.uniform(-0.4, 0.4) * rx
        organ = _ellipse(yy, xx, oy, ox, rng.uniform(0.10, 0.18) * size, rng.uniform(0.10, 0.18) * size) & body
        img = np.where(organ, level, img)
    mask = np.zeros((size, size), dtype=bool)
    n_lesions = 0 if rng.random() < 0.2 else int(rng.integers(1, 4))
    for _ in range(n_lesions):
        r = rng.uniform(*style.radius)
        ly, lx = cy + rng.uniform(-0.6, 0.6) * ry, cx + rng.uniform(-0.6, 0.6) * rx
        lesion = _ellipse(yy, xx, ly, lx, r, r) & body
        sign = 1.0 if rng.random() < 0.5 else -1.0
        img = np.where(lesion, img + sign * style.contrast, img)
        mask |= lesion
    img = gaussian_filter(img, 0.8) + rng.normal(0.0, 0.06, size=img.shape)
    img = style.gain * img + style.offset
    return img.astype(np.float32), mask.astype(np.int64)


def make_site(n: int, size: int, style: SiteStyle, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n slices of one site: x (n, 1, size, size) float32, y (n, size, size) int64."""
    pairs = [one_slice(rng, size, style) for _ in range(n)]
    return np.stack([p[0] for p in pairs])[:, None], np.stack([p[1] for p in pairs])


def make_population(n: int, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n slices, each with a fresh style (the test set)."""
    pairs = [one_slice(rng, size, draw_style(rng, size)) for _ in range(n)]
    return np.stack([p[0] for p in pairs])[:, None], np.stack([p[1] for p in pairs])


def site_sizes(total: int, n_sites: int, alpha: float, minimum: int, rng: np.random.Generator) -> list[int]:
    """Unbalanced site sizes: shares ~ Dirichlet(α) over the sites (the paper's partition with K = 1, where only
    the sizes differ), each site at least `minimum`, summing to `total`."""
    if total < minimum * n_sites:
        raise ValueError(f"{total} slices cannot give {n_sites} sites {minimum} each")
    extra = total - minimum * n_sites
    shares = rng.dirichlet(np.full(n_sites, alpha))
    sizes = np.floor(shares * extra).astype(int)
    sizes[np.argsort(-(shares * extra - sizes))[: extra - int(sizes.sum())]] += 1
    return [int(s) + minimum for s in sizes]
