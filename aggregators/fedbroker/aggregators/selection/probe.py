"""A probe set and a numpy forward pass that evaluates many models of one spec on it at once.

The GA's fitness (docs/algorithms.md, `ga`) compares models by what they compute on a small probe set the
aggregation side holds (public or synthetic data, never a worker's): the penultimate layer's features of
the global model and of each client's, and the cross-entropy of candidate aggregates. A population of
aggregates is one stack of parameter vectors (P, n); every layer runs over the whole stack at once
(einsum over a leading model axis), so a generation costs one batched forward, not P. Pure numpy (no
torch): eval mode, so Dropout is the identity; the layer semantics follow torch's (`fedbroker.layers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from scipy.special import expit

from fedbroker.job.spec import LayerSpec, ModelSpec, output_shapes, parameter_shapes
from fedbroker.layers import LAYERS

GROUP_NORM_EPS = 1e-5  # torch.nn.GroupNorm's default
PROBE_BYTES = 1 << 28  # activations of one forward chunk (float64), so a big model goes in smaller stacks


def _windows(h: np.ndarray, k: int, stride: int) -> np.ndarray:
    """(P, B, C, H, W) → (P, B, C, Ho, Wo, k, k) views of every k×k window at `stride` (no copy)."""
    view = sliding_window_view(h, (k, k), axis=(3, 4))
    return view[:, :, :, ::stride, ::stride]


def _conv(h: np.ndarray, w: np.ndarray, b: np.ndarray | None, p: Mapping[str, int]) -> np.ndarray:
    pad = int(p["padding"])
    if pad:
        h = np.pad(h, ((0, 0), (0, 0), (0, 0), (pad, pad), (pad, pad)))
    out = np.einsum("pbchwij,pocij->pbohw", _windows(h, int(p["kernel_size"]), int(p["stride"])), w, optimize=True)
    return np.asarray(out if b is None else out + b[:, None, :, None, None])


def _group_norm(h: np.ndarray, w: np.ndarray, b: np.ndarray, groups: int) -> np.ndarray:
    shape = h.shape
    g = h.reshape(shape[0], shape[1], groups, -1)
    normed = (g - g.mean(axis=3, keepdims=True)) / np.sqrt(g.var(axis=3, keepdims=True) + GROUP_NORM_EPS)
    extra = (1,) * (len(shape) - 3)
    return np.asarray(normed.reshape(shape) * w.reshape(shape[0], 1, -1, *extra) + b.reshape(shape[0], 1, -1, *extra))


def _layer(layer: LayerSpec, h: np.ndarray, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """One layer over a stack of P models: h is (P, B, ...), tensors have a leading P axis."""
    kind, p = layer.type, layer.params
    w, b = tensors.get("weight"), tensors.get("bias")
    if kind == "Linear":
        assert w is not None
        out = np.matmul(h, np.swapaxes(w, 1, 2))  # one batched GEMM over the stack
        return np.asarray(out if b is None else out + b[:, None, :])
    if kind == "Conv2d":
        assert w is not None
        return _conv(h, w, b, p)
    if kind in ("MaxPool2d", "AvgPool2d"):
        k = int(p["kernel_size"])
        win = _windows(h, k, int(p["stride"] or k))
        return np.asarray(win.max(axis=(5, 6)) if kind == "MaxPool2d" else win.mean(axis=(5, 6)))
    if kind == "Flatten":
        return h.reshape(h.shape[0], h.shape[1], -1)
    if kind == "ReLU":
        return np.asarray(np.maximum(h, 0.0))
    if kind == "Tanh":
        return np.asarray(np.tanh(h))
    if kind == "Sigmoid":
        return np.asarray(expit(h))
    if kind == "Dropout":
        return h
    if kind == "standardize":  # numbers from the spec, per flattened input feature or one for all
        mean, std = (np.asarray(p[name], dtype=np.float64) for name in ("mean", "std"))
        shape = h.shape[2:]
        return np.asarray((h - (mean.reshape(shape) if mean.ndim else mean)) / (std.reshape(shape) if std.ndim else std))
    if kind == "GroupNorm":
        assert w is not None and b is not None
        return _group_norm(h, w, b, int(p["num_groups"]))
    raise ValueError(f"the probe forward pass does not know layer type {kind!r}")


@dataclass(frozen=True)
class Probe:
    """A probe set (x: one sample per row in the model's input shape; y: class indices) for one model spec.

    `coefficients(raw)` turns the chosen updates' raw weights into the job's aggregation coefficients
    (the weighting's normalisation), so an aggregate here is the one the round would build by its mean.
    """

    spec: ModelSpec
    x: np.ndarray
    y: np.ndarray
    coefficients: Callable[[np.ndarray], np.ndarray] = field(default=lambda raw: _proportional(raw))

    def __post_init__(self) -> None:
        if tuple(self.x.shape[1:]) != tuple(self.spec.input_shape):
            raise ValueError(f"probe samples have shape {list(self.x.shape[1:])}, the model reads "
                             f"{list(self.spec.input_shape)}")
        if self.y.shape != (self.x.shape[0],) or self.x.shape[0] == 0:
            raise ValueError(f"probe set needs one label per sample and at least one sample, got x {self.x.shape}, "
                             f"y {self.y.shape}")

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's tensors by state_dict name, in the order of a flat parameter vector."""
        return parameter_shapes(self.spec)

    @property
    def size(self) -> int:
        """The number of parameters of one model."""
        return sum(math.prod(s) for s in self.shapes.values())

    def _last_weighted(self) -> int:
        return max(i for i, layer in enumerate(self.spec.layers) if LAYERS[layer.type].weighted)

    @property
    def models_per_forward(self) -> int:
        """How many models one forward stacks: their float64 parameters, and the largest array a layer
        makes for them, each stay under PROBE_BYTES."""
        return min(self._chunk(), max(1, PROBE_BYTES // (8 * self.size)))

    def _chunk(self) -> int:
        """How many models' largest layer array (its output, its weights, or a convolution's unfolded
        windows) fits in PROBE_BYTES."""
        widest = math.prod(self.spec.input_shape)
        for layer, out in zip(self.spec.layers, output_shapes(self.spec)):
            sizes = [math.prod(out), *(math.prod(s) for s in LAYERS[layer.type].tensors(layer.params).values())]
            if layer.type == "Conv2d":  # the windows einsum may unfold: C_in·k² values per output position
                k = int(layer.params["kernel_size"])
                sizes.append(int(layer.params["in_channels"]) * k * k * math.prod(out[1:]))
            widest = max(widest, *sizes)
        return int(max(1, PROBE_BYTES // (8 * self.x.shape[0] * widest)))

    def forward(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(features (P, B, D), outputs (P, B, C)) of the P models whose flat parameters are `vectors`'
        rows (state-dict order of `parameter_shapes`); features are the last weighted layer's inputs."""
        v = np.asarray(vectors)
        if v.ndim != 2 or v.shape[1] != self.size:
            raise ValueError(f"expected (models, {self.size}) parameters, got {v.shape}")
        feats, outs = [], []
        chunk = self.models_per_forward
        for start in range(0, v.shape[0], chunk):
            f, o = self._forward(np.asarray(v[start:start + chunk], dtype=np.float64))
            feats.append(f)
            outs.append(o)
        return np.concatenate(feats), np.concatenate(outs)

    def _forward(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tensors: dict[int, dict[str, np.ndarray]] = {}
        offset = 0
        for name, shape in self.shapes.items():
            index, suffix = name.split(".", 1)
            n = math.prod(shape)
            tensors.setdefault(int(index), {})[suffix] = v[:, offset:offset + n].reshape((v.shape[0], *shape))
            offset += n
        h = np.broadcast_to(np.asarray(self.x, dtype=np.float64), (v.shape[0], *self.x.shape))
        last = self._last_weighted()
        features = h
        for i, layer in enumerate(self.spec.layers):
            if i == last:
                features = h.reshape(h.shape[0], h.shape[1], -1)
            h = _layer(layer, h, tensors.get(i, {}))
        return features, h.reshape(h.shape[0], h.shape[1], -1)

    def cross_entropy(self, vectors: np.ndarray) -> np.ndarray:
        """Mean cross-entropy on the probe set of each model (row of `vectors`): (P,)."""
        _, logits = self.forward(vectors)
        top = logits.max(axis=2, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=2)) + top[..., 0]
        picked = np.take_along_axis(logits, self.y[None, :, None].astype(np.intp), axis=2)[..., 0]
        ce: np.ndarray = (log_z - picked).mean(axis=1)
        return ce

    def feature_cosine(self, vectors: np.ndarray, global_vector: np.ndarray) -> np.ndarray:
        """Per model: the mean over probe samples of cos(global features, model features) (0 where a
        feature vector is zero, e.g. every ReLU off): (P,)."""
        stacked = np.vstack([np.asarray(global_vector, dtype=np.float64)[None, :], vectors])
        feats, _ = self.forward(stacked)
        g, f = feats[0][None], feats[1:]
        dot = (g * f).sum(axis=2)
        norms = np.linalg.norm(g, axis=2) * np.linalg.norm(f, axis=2)
        cos: np.ndarray = np.divide(dot, norms, out=np.zeros_like(dot), where=norms > 0).mean(axis=1)
        return cos


def _proportional(raw: np.ndarray) -> np.ndarray:
    total = float(np.sum(raw))
    return raw / total if total > 0 else np.full(raw.shape, 1.0 / raw.shape[0])
