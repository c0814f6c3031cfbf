"""Synthetic stand-ins for the imaging study: a PathMNIST-like tissue set and a disjoint pretext set.

Nothing is downloaded: MedMNIST fetches its arrays at run time from a host this machine cannot reach, so
`tissue` draws a stand-in from the recipe below and every table names it "synthetic stand-in".

**Tissue (9 classes, 3×28×28, PathMNIST's shape and class count).** Each image is an H&E stain rendered by
Beer–Lambert from two density maps on a 56×56 grid, then averaged 2×2 down to 28×28:
RGB = exp(−(h·OD_H + e·OD_E)) with the haematoxylin and eosin optical-density vectors OD_H = (0.65, 0.70, 0.29),
OD_E = (0.07, 0.99, 0.11) (Ruifrok & Johnston). The class sets the maps, loosely after NCT-CRC-HE's classes:

| class | haematoxylin h (nuclei) | eosin e (cytoplasm, fibres) |
|---|---|---|
| 0 adipose | few small nuclei | thin membranes: the edges of a Voronoi tiling of 6–10 cells |
| 1 background | none | faint smooth noise |
| 2 debris | 10–30 fragments of random size | patchy smooth noise |
| 3 lymphocytes | 60–110 small round dense nuclei | low |
| 4 mucus | faint smooth noise | faint smooth noise, wispy |
| 5 smooth muscle | 8–16 elongated nuclei along one angle | fibres: a grating along the same angle |
| 6 normal mucosa | nuclei on 2–4 rings (glands) around empty lumens | moderate between glands |
| 7 stroma | 4–10 elongated nuclei at random angles | loose wavy fibres, random angle |
| 8 tumour | 30–55 large irregular nuclei, crowded | moderate |

Every image then gets its own stain jitter (each stain's strength × exp(N(0, 0.25)), each OD vector's
components × exp(N(0, 0.1))), a brightness factor U(0.85, 1.1), and N(0, `noise`) pixel noise; values are
clipped to [0, 1]. Counts, sizes and angles are drawn per image from the ranges above, which overlap across
classes (tumour vs normal mucosa vs lymphocytes; stroma vs muscle; mucus vs background), so the task is not
separable by colour alone.

**Pretext (10 classes, 3×28×28): coloured shapes**, a recipe with no tissue in it: a filled disc, square,
triangle, ring, cross, horizontal bars, vertical bars, diagonal bars, checkerboard and dots, each in a random
colour on a random background colour, at a random position and size, plus N(0, 0.1) noise. It stands in for
the "public pretext set" a pretrained backbone was trained on; it shares no class and no recipe with `tissue`.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

TISSUE_CLASSES = ("adipose", "background", "debris", "lymphocytes", "mucus", "smooth muscle", "normal mucosa",
                  "stroma", "tumour")
PRETEXT_CLASSES = ("disc", "square", "triangle", "ring", "cross", "h-bars", "v-bars", "diagonal bars",
                   "checkerboard", "dots")
OD_H = np.array([0.65, 0.70, 0.29])
OD_E = np.array([0.07, 0.99, 0.11])
GRID = 56  # rendered at 2× and averaged down to 28×28
SIZE = 28


def _smooth(rng: np.random.Generator, sigma: float) -> np.ndarray:
    """Smooth noise in [0, 1] on the grid (a Gaussian-filtered white field, rescaled)."""
    field = ndimage.gaussian_filter(rng.normal(size=(GRID, GRID)), sigma, mode="wrap")
    return (field - field.min()) / (np.ptp(field) + 1e-9)


def _nuclei(rng: np.random.Generator, count: int, radius: tuple[float, float], *, stretch: float = 1.0,
            angle: float | None = None, centres: np.ndarray | None = None) -> np.ndarray:
    """A haematoxylin map of `count` elliptical nuclei (semi-axes r·stretch along `angle`, r across)."""
    yy, xx = np.mgrid[0:GRID, 0:GRID].astype(np.float64)
    out = np.zeros((GRID, GRID))
    pts = centres if centres is not None else rng.uniform(0, GRID, (count, 2))
    for cy, cx in pts:
        r = rng.uniform(*radius)
        a = rng.uniform(0, np.pi) if angle is None else angle + rng.normal(0, 0.1)
        dy, dx = yy - cy, xx - cx
        u, v = dx * np.cos(a) + dy * np.sin(a), -dx * np.sin(a) + dy * np.cos(a)
        out = np.maximum(out, np.exp(-((u / (r * stretch)) ** 2 + (v / r) ** 2) ** 2))
    return out


def _fibres(rng: np.random.Generator, angle: float, period: float, wavy: float) -> np.ndarray:
    yy, xx = np.mgrid[0:GRID, 0:GRID].astype(np.float64)
    along = xx * np.cos(angle) + yy * np.sin(angle)
    across = -xx * np.sin(angle) + yy * np.cos(angle)
    phase = wavy * np.sin(along / rng.uniform(4, 9)) + rng.uniform(0, 2 * np.pi)
    return 0.5 + 0.5 * np.sin(2 * np.pi * across / period + phase)


def _voronoi_edges(rng: np.random.Generator, cells: int) -> np.ndarray:
    yy, xx = np.mgrid[0:GRID, 0:GRID].astype(np.float64)
    pts = rng.uniform(0, GRID, (cells, 2))
    d = np.sort(np.hypot(yy[..., None] - pts[:, 0], xx[..., None] - pts[:, 1]), axis=-1)
    return np.exp(-(((d[..., 1] - d[..., 0]) / 1.5) ** 2))


def _tissue_maps(rng: np.random.Generator, label: int) -> tuple[np.ndarray, np.ndarray]:
    """(haematoxylin, eosin) density maps of one image of class `label`."""
    if label == 0:    # adipose
        return 0.6 * _nuclei(rng, int(rng.integers(0, 4)), (1.5, 2.5)), 0.9 * _voronoi_edges(rng, int(rng.integers(6, 11)))
    if label == 1:    # background
        return 0.05 * _smooth(rng, 6), 0.15 * _smooth(rng, 8)
    if label == 2:    # debris
        frag = _nuclei(rng, int(rng.integers(10, 31)), (0.8, 3.5), stretch=rng.uniform(1, 2))
        return 0.7 * frag * _smooth(rng, 3), 0.5 * _smooth(rng, 3)
    if label == 3:    # lymphocytes
        return 1.1 * _nuclei(rng, int(rng.integers(60, 111)), (1.6, 2.4)), 0.25 * _smooth(rng, 5)
    if label == 4:    # mucus
        return 0.2 * _smooth(rng, 5), 0.35 * _smooth(rng, 4) ** 2
    if label == 5:    # smooth muscle
        a = rng.uniform(0, np.pi)
        return 0.8 * _nuclei(rng, int(rng.integers(8, 17)), (1.2, 1.8), stretch=3.0, angle=a), \
            0.5 + 0.4 * _fibres(rng, a, rng.uniform(3, 5), 0.3)
    if label == 6:    # normal mucosa: nuclei on rings around lumens
        centres, lumen = [], np.zeros((GRID, GRID))
        yy, xx = np.mgrid[0:GRID, 0:GRID].astype(np.float64)
        for _ in range(int(rng.integers(2, 5))):
            cy, cx, r = rng.uniform(8, 48), rng.uniform(8, 48), rng.uniform(6, 11)
            t = rng.uniform(0, 2 * np.pi, int(2 * np.pi * r / 3.2))
            centres.append(np.stack([cy + r * np.sin(t), cx + r * np.cos(t)], axis=1))
            lumen = np.maximum(lumen, (np.hypot(yy - cy, xx - cx) < r - 2.5).astype(float))
        h = _nuclei(rng, 0, (1.8, 2.6), centres=np.concatenate(centres))
        return 0.9 * h, 0.55 * (1 - lumen) * (0.6 + 0.4 * _smooth(rng, 4))
    if label == 7:    # stroma
        a = rng.uniform(0, np.pi)
        return 0.7 * _nuclei(rng, int(rng.integers(4, 11)), (1.0, 1.6), stretch=3.5), \
            0.25 + 0.45 * _fibres(rng, a, rng.uniform(4, 8), 2.0) * _smooth(rng, 5)
    # 8 tumour
    return 1.0 * _nuclei(rng, int(rng.integers(30, 56)), (2.2, 3.6), stretch=rng.uniform(1.0, 1.6)), \
        0.4 + 0.2 * _smooth(rng, 4)


def _render(rng: np.random.Generator, h: np.ndarray, e: np.ndarray, noise: float) -> np.ndarray:
    strength = np.exp(rng.normal(0, 0.25, 2))
    od_h, od_e = OD_H * np.exp(rng.normal(0, 0.1, 3)), OD_E * np.exp(rng.normal(0, 0.1, 3))
    od = strength[0] * h[..., None] * od_h + strength[1] * e[..., None] * od_e
    rgb = rng.uniform(0.85, 1.1) * np.exp(-od)                                  # (56, 56, 3)
    rgb = rgb.reshape(SIZE, 2, SIZE, 2, 3).mean(axis=(1, 3)).transpose(2, 0, 1)  # (3, 28, 28)
    return np.clip(rgb + rng.normal(0, noise, rgb.shape), 0.0, 1.0)


def tissue(n: int, seed: int, *, noise: float = 0.08) -> tuple[np.ndarray, np.ndarray]:
    """`n` synthetic stand-in tissue images (float32 (n, 3, 28, 28) in [0, 1]) and labels (int64, balanced
    up to rounding), from `seed` alone."""
    rng = np.random.default_rng([seed, 1])
    y = rng.permutation(np.arange(n) % len(TISSUE_CLASSES)).astype(np.int64)
    x = np.stack([_render(rng, *_tissue_maps(rng, int(label)), noise) for label in y]) if n else \
        np.zeros((0, 3, SIZE, SIZE))
    return x.astype(np.float32), y


def _shape_mask(rng: np.random.Generator, label: int) -> np.ndarray:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
    cy, cx, r = rng.uniform(9, 19), rng.uniform(9, 19), rng.uniform(5, 9)
    dy, dx = yy - cy, xx - cx
    period = rng.uniform(3, 6)
    masks = [
        np.hypot(dy, dx) < r,                                                   # disc
        (np.abs(dy) < r * 0.8) & (np.abs(dx) < r * 0.8),                        # square
        (dy < r * 0.7) & (dy > -r + 2 * np.abs(dx)),                            # triangle
        np.abs(np.hypot(dy, dx) - r) < 1.6,                                     # ring
        ((np.abs(dy) < 1.8) | (np.abs(dx) < 1.8)) & (np.hypot(dy, dx) < r),     # cross
        np.sin(2 * np.pi * yy / period) > 0,                                    # horizontal bars
        np.sin(2 * np.pi * xx / period) > 0,                                    # vertical bars
        np.sin(2 * np.pi * (xx + yy) / (period * 1.4)) > 0,                     # diagonal bars
        (np.floor(yy / period) + np.floor(xx / period)) % 2 == 0,               # checkerboard
        (np.sin(2 * np.pi * yy / period) > 0.6) & (np.sin(2 * np.pi * xx / period) > 0.6),  # dots
    ]
    return masks[label].astype(np.float64)


def pretext(n: int, seed: int, *, noise: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """`n` coloured-shape images (float32 (n, 3, 28, 28) in [0, 1]) and labels in 0..9, from `seed` alone."""
    rng = np.random.default_rng([seed, 2])
    y = rng.permutation(np.arange(n) % len(PRETEXT_CLASSES)).astype(np.int64)
    x = np.zeros((n, 3, SIZE, SIZE))
    for i, label in enumerate(y):
        mask = _shape_mask(rng, int(label))
        fg, bg = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
        x[i] = mask * fg[:, None, None] + (1 - mask) * bg[:, None, None] + rng.normal(0, noise, (3, SIZE, SIZE))
    return np.clip(x, 0.0, 1.0).astype(np.float32), y
