"""Per-sample clipping in one backward pass ("bk", book-keeping; Bu et al. 2022), for the trainer's DP mode "bk".

Each trainable layer's per-sample gradient is a function of what the layer saw (its input a_i) and
what came back (the gradient g_i of the loss with respect to its output). A forward hook keeps a_i
and puts a tensor hook on the output that keeps g_i; the backward pass runs with the parameters'
`requires_grad` off, so autograd forms no weight gradient at all (and nothing per sample), only the
gradients that flow between layers. From (a, g) this module forms, per layer:

- per-sample squared norms. Linear on (batch, features): ‖g_i a_iᵀ‖² = ‖g_i‖²·‖a_i‖², no gradient
  formed. Linear on sequences and Conv2d (input unfolded into T positions of D features, output
  O channels): the ghost norm Σ_{t,s}(g_t·g_s)(a_t·a_s) from two T×T Gram matrices where that is
  cheaper (T·(O+D) < O·D, deep layers with few positions), else the per-sample gradients
  themselves (n×O×D, shallow layers with few parameters). GroupNorm/LayerNorm: Σ_t g·x̂ and Σ_t g
  per sample, with x̂ the normalised input recomputed from a.
- then, with c_i = min(1, C/(‖g_i‖+1e-6)) over all layers (Opacus's factor), the clipped sum
  Σ_i c_i·∇_i: one matrix product (c⊙G)ᵀA per Linear/ghost layer, c·(per-sample gradients) elsewhere.

The sum is left in each parameter's .grad, as Opacus's fast gradient clipping leaves it, and
`FlatGhostDPOptimizer` noises and averages it: the mechanism and the accountant are Opacus's. A
module called several times in one forward pass is handled (its calls' positions are concatenated);
a layer whose output never reaches the loss contributes zeros. tests/worker/test_dp_clipping.py pins
the clipped sum to Opacus's materialised per-sample clipping.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.grad import conv2d_weight

from fedbroker.worker import layer_clipping

# Layers whose per-sample gradients this module forms; Conv2d only ungrouped, zero-padded, numeric padding.
LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.LayerNorm)
# Unfolded inputs are formed for at most this many floats at a time (4 MiB), which then stay in cache.
CHUNK_FLOATS = 1 << 20


def supported(model: nn.Module) -> bool:
    """True when every trainable parameter sits in an unshared layer this module can clip (see LAYERS)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        own = layer_clipping.own_parameters(module)
        if own and type(module) not in LAYERS and not layer_clipping.handles(module):
            return False
        if own and isinstance(module, nn.Conv2d) and (
            module.groups != 1 or module.padding_mode != "zeros" or isinstance(module.padding, str)
        ):
            return False
        for p in own:
            holders[id(p)] = holders.get(id(p), 0) + 1
    return all(count == 1 for count in holders.values())  # a tied parameter's per-sample gradient spans layers


class BookkeepingClipper:
    """Hooks on `model`'s trainable layers; `backward(x, y)` forms the clipped per-sample sum of a batch.

    The sum is kept as one flat vector in the order of `params` (the DP optimizer's), which
    `take_clipped_sum` hands over once. `cleanup` removes the hooks.
    """

    def __init__(self, model: nn.Module, *, max_grad_norm: float, params: list[nn.Parameter]) -> None:
        if not supported(model):
            raise ValueError("book-keeping clipping needs every trainable parameter in an unshared "
                             + ", ".join(t.__name__ for t in LAYERS) + " layer")
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.params = list(params)
        # Per trainable layer: (module, its trained weight or None, its trained bias or None, calls this pass).
        self._layers: list[tuple[nn.Module, torch.Tensor | None, torch.Tensor | None, list[list[Any]]]] = []
        for m in model.modules():
            weight, bias = (p if isinstance(p, torch.Tensor) and p.requires_grad else None
                            for p in (getattr(m, "weight", None), getattr(m, "bias", None)))
            if (type(m) in LAYERS or layer_clipping.handles(m)) and (weight is not None or bias is not None):
                self._layers.append((m, weight, bias, []))
        order = [p for _, weight, bias, _ in self._layers for p in (weight, bias) if p is not None]
        if sorted(map(id, order)) != sorted(map(id, self.params)):
            raise ValueError("the optimizer's parameters are not the model's trainable ones")
        # Where each layer's sums go in `params` order (None: the orders agree, one concatenation suffices).
        position = {id(p): i for i, p in enumerate(self.params)}
        self._reorder = None if [position[id(p)] for p in order] == list(range(len(order))) else [
            position[id(p)] for p in order]
        self._calls = {id(m): calls for m, _, _, calls in self._layers}
        self._root: torch.Tensor | None = None  # set during a forward pass: the graph's one leaf
        self._leaf: torch.Tensor | None = None  # that leaf, kept between passes (autograd.grad never fills its .grad)
        self._clipped: torch.Tensor | None = None
        self._handles = [m.register_forward_hook(self._forward_hook) for m, _, _, _ in self._layers]

    def cleanup(self) -> None:
        """Remove the hooks: the trainer's throw-away copy of the model is then plain again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take_clipped_sum(self) -> torch.Tensor | None:
        """The last backward pass's clipped sum (flat, `params` order), once; None when none is pending."""
        clipped, self._clipped = self._clipped, None
        return clipped

    def _forward_hook(self, module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        if self._root is None:
            return None
        if not output.requires_grad:
            # A layer applied to the data itself: adding the zero leaf puts its output in the graph without
            # asking for the gradient of its input (the backward pass then stops here), and a copy, unlike
            # the output itself, may be modified in place by the next layer.
            output = output + self._root
        record = [inputs[0].detach(), None]
        self._calls[id(module)].append(record)

        def keep(grad: torch.Tensor) -> None:
            record[1] = grad

        output.register_hook(keep)
        return output

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One forward and backward pass of the summed cross-entropy; returns the mean loss.

        The parameters' `requires_grad` is off meanwhile, so autograd forms no weight gradient; the clipped
        sum Σ_i c_i·∇_i loss_i is then formed from the captured activations and output gradients.
        """
        if self._clipped is not None:
            raise RuntimeError("the previous batch's clipped sum was never taken by the optimizer")
        for p in self.params:
            p.requires_grad_(False)
        if self._leaf is None or self._leaf.device != x.device or self._leaf.dtype != x.dtype:
            self._leaf = torch.zeros((), device=x.device, dtype=x.dtype, requires_grad=True)
        self._root = self._leaf
        try:
            loss = F.cross_entropy(self.model(x), y, reduction="sum")
            if loss.requires_grad:
                torch.autograd.grad(loss, self._root)
            self._clipped = self._clip(len(y), x.device, x.dtype)
        finally:
            self._root = None
            for p in self.params:
                p.requires_grad_(True)
            for _, _, _, calls in self._layers:
                calls.clear()
        return float(loss.detach()) / len(y)

    def _clip(self, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        norms2 = torch.zeros(n, device=device, dtype=dtype)
        finishers: list[Finisher] = []
        for module, weight, bias, records in self._layers:
            # (input, output gradient) per call that reached the loss; records are [input, gradient] lists
            calls = cast(list[tuple[torch.Tensor, torch.Tensor]], records) if len(records) == 1 and records[0][1] \
                is not None else [(a, g) for a, g in records if g is not None]
            if isinstance(module, nn.GroupNorm | nn.LayerNorm):
                finishers.append(_norm_layer(module, weight, bias, calls, n, norms2))
            elif type(module) in (nn.Linear, nn.Conv2d):
                finishers.append(_matmul_layer(cast(nn.Linear, module), weight, bias, calls, n, norms2))
            else:  # the layers of fedbroker.worker.layer_clipping
                finishers.append(layer_clipping.rule(module)(module, weight, bias, calls, n, norms2))
        # Opacus's clip factor min(1, C / (‖g_i‖ + 1e-6)), in place (C / t is t.reciprocal() * C in torch too)
        factor = norms2.sqrt_().add_(1e-6).reciprocal_().mul_(self.max_grad_norm).clamp_(max=1.0)
        sums = [t.view(-1) for finish in finishers for t in finish(factor)]
        if self._reorder is not None:
            ordered: list[torch.Tensor] = [sums[0]] * len(sums)
            for i, t in zip(self._reorder, sums):
                ordered[i] = t
            sums = ordered
        return torch.cat(sums)


def ghost_norm_cheaper(positions: int, out_dim: int, in_dim: int) -> bool:
    """Whether two T×T Gram matrices (T²·(O+D) products per sample) cost less than forming the O×D
    per-sample gradient (T·O·D): deep layers with few positions take the ghost norm, shallow ones the gradient."""
    return positions * (out_dim + in_dim) < out_dim * in_dim


# Forms a layer's clipped sums from the clip factors: one tensor per trained parameter, weight before bias.
Finisher = Callable[[torch.Tensor], list[torch.Tensor]]


def _matmul_layer(module: nn.Linear | nn.Conv2d, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  calls: list[tuple[torch.Tensor, torch.Tensor]], n: int, norms2: torch.Tensor) -> Finisher:
    """Adds a Linear/Conv2d layer's per-sample squared norms to `norms2`; returns what forms its clipped sums.

    `weight` and `bias` are the trained ones (None: frozen or absent)."""
    if not calls:  # the layer never reached the loss: every per-sample gradient is zero
        return lambda factor: [torch.zeros_like(p) for p in (weight, bias) if p is not None]
    if len(calls) == 1 and calls[0][0].dim() == 2 and isinstance(module, nn.Linear):
        a, g = calls[0]  # rank one per sample: ‖g_i a_iᵀ‖ = ‖g_i‖·‖a_i‖, and the bias's is ‖g_i‖
        g2 = torch.linalg.vecdot(g, g)
        if weight is None:
            norms2.add_(g2)
        else:
            a2 = torch.linalg.vecdot(a, a)
            norms2.addcmul_(g2, a2 if bias is None else a2.add_(1))

        def finish_rank_one(factor: torch.Tensor) -> list[torch.Tensor]:
            g_t = g.t()
            sums = [] if weight is None else [torch.mm(g_t * factor, a)]
            return sums if bias is None else [*sums, torch.mv(g_t, factor)]
        return finish_rank_one
    # Positions last: A (n, D, T) inputs (unfolded for Conv2d), G (n, O, T) output gradients; formed in
    # chunks of samples so that the unfolded inputs stay in cache.
    conv = module if isinstance(module, nn.Conv2d) else None
    padding = cast(tuple[int, ...], conv.padding) if conv else (0,)  # numeric: `supported` refuses the others
    shape = module.weight.shape
    out_dim, in_dim = shape[0], math.prod(shape[1:])
    positions = sum(g[0].numel() // out_dim for _, g in calls)
    ghost = ghost_norm_cheaper(positions, out_dim, in_dim)
    step = max(1, CHUNK_FLOATS // (positions * in_dim))
    per_sample: list[torch.Tensor] = []
    if weight is not None:
        for lo in range(0, n, step):
            a_parts, g_parts = [], []
            for a, g in calls:
                a, g = a[lo : lo + step], g[lo : lo + step]
                if conv:
                    a_parts.append(F.unfold(a, conv.kernel_size, conv.dilation, padding, conv.stride))
                    g_parts.append(g.flatten(2))
                else:
                    a_parts.append(a.reshape(len(a), -1, in_dim).transpose(1, 2))
                    g_parts.append(g.reshape(len(g), -1, out_dim).transpose(1, 2))
            A = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts, dim=2)
            G = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts, dim=2)
            if ghost:
                gram = torch.bmm(G.transpose(1, 2), G).mul_(torch.bmm(A.transpose(1, 2), A))
                norms2[lo : lo + step] += gram.sum((1, 2))
            else:  # few parameters: the per-sample gradients themselves (chunk, O·D), kept for the clipped sum
                chunk = torch.bmm(G, A.transpose(1, 2)).flatten(1)
                norms2[lo : lo + step] += chunk.square().sum(1)
                per_sample.append(chunk)
    g_sum: torch.Tensor | None = None
    if bias is not None:
        g_sum = torch.stack([g.reshape(n, out_dim, -1).sum(2) if conv else g.reshape(n, -1, out_dim).sum(1)
                             for _, g in calls]).sum(0)
        norms2.add_(g_sum.square().sum(1))

    def finish(factor: torch.Tensor) -> list[torch.Tensor]:
        sums: list[torch.Tensor] = []
        if per_sample:
            sums.append(factor @ (per_sample[0] if len(per_sample) == 1 else torch.cat(per_sample)))
        elif weight is not None:  # Σ_i c_i g_i a_iᵀ is the weight gradient of the factor-scaled output gradients
            total = torch.zeros_like(weight)
            for a, g in calls:
                gc = g * factor.view(-1, *[1] * (g.dim() - 1))
                if conv:
                    total += conv2d_weight(a, shape, gc, conv.stride, padding, conv.dilation)
                else:
                    total += gc.reshape(-1, out_dim).t() @ a.reshape(-1, in_dim)
            sums.append(total)
        if g_sum is not None:
            sums.append(factor @ g_sum)
        return sums
    return finish


def _norm_layer(module: nn.GroupNorm | nn.LayerNorm, weight: torch.Tensor | None, bias: torch.Tensor | None,
                calls: list[tuple[torch.Tensor, torch.Tensor]], n: int, norms2: torch.Tensor) -> Finisher:
    """GroupNorm/LayerNorm: per-sample gradients Σ g·x̂ (weight) and Σ g (bias), (n, features), summed over calls."""
    gw: torch.Tensor | None = None
    gb: torch.Tensor | None = None
    for a, g in calls:
        if isinstance(module, nn.GroupNorm):
            x_hat = F.group_norm(a, module.num_groups, eps=module.eps)
            features = module.num_channels
            gw_call = (g * x_hat).reshape(n, features, -1).sum(2)
            gb_call = g.reshape(n, features, -1).sum(2)
        else:
            shape = tuple(module.normalized_shape)
            x_hat = F.layer_norm(a, shape, eps=module.eps)
            features = math.prod(shape)
            gw_call = (g * x_hat).reshape(n, -1, features).sum(1)
            gb_call = g.reshape(n, -1, features).sum(1)
        gw = gw_call if gw is None else gw + gw_call
        gb = gb_call if gb is None else gb + gb_call
    per_sample = []
    for p, grads in ((weight, gw), (bias, gb)):
        if p is not None:
            grads = torch.zeros((n, p.numel()), device=p.device, dtype=p.dtype) if grads is None else grads
            norms2.add_(grads.square().sum(1))
            per_sample.append(grads)
    return lambda factor: [factor @ grads for grads in per_sample]
