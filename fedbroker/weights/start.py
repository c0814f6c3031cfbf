"""Starting weights: a safetensors file read against the SHA-256 the job pins, decoded without pickle
(the `safetensors` library: a JSON header and raw little-endian bytes, nothing executable), checked against
the model by name and shape, finite values only; and the canonical digest of a set of weights, which lets
a site check that the start weights it was given are those the job's view shows."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import numpy as np

from fedbroker.errors import ConfigError
from fedbroker.job.model_spec import ModelSpec
from fedbroker.weights.plan import ModelPlan, trainable_names

MAX_START_BYTES = 2 << 30          # a start file larger than this is refused before it is read
_DTYPES = ("float32", "float16", "float64")


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of `data` as lower-case hex (what `sha256sum` prints)."""
    return hashlib.sha256(data).hexdigest()


def read_pinned(path: str | os.PathLike[str], *, sha256: str, where: str = "model.initial_weights") -> bytes:
    """The bytes of the file at `path`, refused unless their SHA-256 is the pinned one."""
    try:
        size = os.path.getsize(path)
        if size > MAX_START_BYTES:
            raise ConfigError(f"{where}.path", f"{os.fspath(path)!r} holds {size} bytes, more than the limit of "
                                               f"{MAX_START_BYTES}")
        with open(path, "rb") as fh:
            data = fh.read(MAX_START_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{where}.path", f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    check_pin(data, sha256=sha256, where=where)
    return data


def check_pin(data: bytes, *, sha256: str, where: str = "model.initial_weights") -> None:
    """Refuse bytes whose SHA-256 is not the pinned one, naming both digests."""
    got = sha256_hex(data)
    if got != sha256:
        raise ConfigError(f"{where}.sha256", f"the weights' SHA-256 is {got}, the job pins {sha256}: not the "
                                             f"file the job names")


def decode(data: bytes, *, where: str = "model.initial_weights") -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as float32 arrays; a file that does not parse, or a tensor of a dtype
    other than float16/32/64, raises ConfigError."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(data)
    except (SafetensorError, ValueError, TypeError) as exc:
        raise ConfigError(where, f"is not a safetensors file of numeric tensors: {exc}") from None
    bad = sorted(name for name, t in tensors.items() if t.dtype.name not in _DTYPES)
    if bad:
        raise ConfigError(where, f"tensor {bad[0]!r} has dtype {tensors[bad[0]].dtype.name}; start weights are "
                                 f"{', '.join(_DTYPES)}")
    return {name: np.ascontiguousarray(t, dtype=np.float32) for name, t in tensors.items()}


def encode(tensors: Mapping[str, np.ndarray]) -> bytes:
    """Weights as safetensors bytes (float32)."""
    from safetensors.numpy import save

    return save({name: np.ascontiguousarray(t, dtype=np.float32) for name, t in tensors.items()})


def start_problems(shapes: Mapping[str, tuple[int, ...]], tensors: Mapping[str, np.ndarray], *,
                   where: str = "model.initial_weights") -> list[ConfigError]:
    """Every way the weights do not fit the model, each naming its tensor (and so its node): missing, extra,
    of another shape, or holding NaN or an infinity."""
    out: list[ConfigError] = []
    for name in sorted(set(shapes) - set(tensors)):
        out.append(ConfigError(f"{where}.{name}", f"is missing: node {name.rsplit('.', 1)[0]!r} needs a tensor "
                                                  f"of shape {list(shapes[name])}"))
    for name in sorted(set(tensors) - set(shapes)):
        out.append(ConfigError(f"{where}.{name}", "is no tensor of the model (extra)"))
    for name, shape in shapes.items():
        value = tensors.get(name)
        if value is None:
            continue
        if tuple(value.shape) != tuple(shape):
            out.append(ConfigError(f"{where}.{name}", f"has shape {list(value.shape)}; node "
                                                      f"{name.rsplit('.', 1)[0]!r} needs {list(shape)}"))
        elif not np.all(np.isfinite(value)):
            out.append(ConfigError(f"{where}.{name}", "holds NaN or infinite values"))
    return out


def weights_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """A canonical SHA-256 of weights: over the sorted names, each with its shape and its float32
    little-endian bytes. Equal weights give equal digests whatever file or wire carried them."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name], dtype="<f4")
        h.update(f"{name}\0{list(value.shape)}\0".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def frozen_digest(tensors: Mapping[str, np.ndarray], spec: ModelSpec, plan: ModelPlan) -> str:
    """The digest of a job's frozen tensors ("" when every tensor trains): they never change from the start
    weights, so every global version a site receives must show the digest the job's settings pin."""
    if not plan.restricts_training:
        return ""
    trained = set(trainable_names(spec, plan))
    return weights_digest({name: value for name, value in tensors.items() if name not in trained})
