"""Write the image example's IDX files (the MNIST file format) from scikit-learn's 8×8 handwritten digits:
unsigned-byte images and labels, split into train and t10k files as MNIST ships them. Nothing is downloaded.

    .venv/bin/python examples/image-cnn-idx/make_data.py [--out DIR]
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits


def write_idx(path: Path, array: np.ndarray) -> None:
    """The IDX layout: two zero bytes, type code 0x08 (unsigned byte), the number of dimensions, each
    dimension as a big-endian uint32, then the bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    images = np.clip(np.rint(digits.images * (255 / 16)), 0, 255).astype(np.uint8)  # 0..16 → 0..255
    order = np.random.default_rng(0).permutation(len(images))
    cut = int(0.8 * len(order))
    for prefix, part in (("train", order[:cut]), ("t10k", order[cut:])):
        write_idx(out / f"{prefix}-images-idx3-ubyte", images[part])
        write_idx(out / f"{prefix}-labels-idx1-ubyte", digits.target[part].astype(np.uint8))
    print(f"wrote IDX files for {len(images)} 8×8 images to {out}")


if __name__ == "__main__":
    main()
