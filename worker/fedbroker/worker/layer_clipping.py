"""More layers for the one-pass ("bk") clipping of `fedbroker.worker.one_pass_clipping`: Conv1d and Conv3d,
ConvTranspose2d/3d and Embedding by our own rules, and the layers Opacus writes for DP (the RNNLinear cells
of DPLSTM/DPGRU) by Opacus's registered grad samplers, inside the same pass. So a model mixing both
(Embedding → DPLSTM → Linear, Embedding → encoder layer → Linear) is clipped in one forward and one backward
pass; DPMultiheadAttention is made of nn.Linear layers on sequences, which bk clips itself.

Each rule takes what the pass kept per call of a layer (its input a and its output gradient g, batch first)
and adds the layer's per-sample squared gradient norms to `norms2`; it returns what forms the layer's clipped
sum Σ_i c_i·∇_i from the clip factors c:

- Conv1d/Conv3d: the input unfolded into T positions of D = C_in·k^d features, G the (O, T) output
  gradient; the per-sample gradient is G·Aᵀ. Its norm is the ghost norm Σ_{t,s}(g_t·g_s)(a_t·a_s) where two
  T×T Gram matrices cost less than the O×D gradient, else the gradient itself; the clipped sum is torch's
  weight gradient of the c-scaled output gradients.
- ConvTranspose2d/3d: the adjoint of a convolution with the same weight, so its per-sample gradient is
  a·unfold(g)ᵀ (the output gradient unfolded with the layer's kernel, stride and padding, at the input's
  positions), laid out (in, out, k…) as torch holds the weight.
- Embedding: the gradient of row v is the sum of g_t over the positions t whose id is v, so
  ‖∇_i‖² = Σ_{t,s: id_t = id_s} g_t·g_s (a T×T Gram matrix masked by equal ids) and the clipped sum scatters
  c_i·g_t into the rows; nothing of size vocabulary × width is formed per sample.
- Opacus's DP layers: the registered grad sampler's per-sample gradients, summed over the calls (one per
  time step for an RNN cell).

tests/worker/test_dp_layer_clipping.py pins every layer type, and whole models, to Opacus's GradSampleModule.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn import grad as nn_grad

Calls = list[tuple[torch.Tensor, torch.Tensor]]
# Forms a layer's clipped sums from the clip factors: one tensor per trained parameter, weight before bias.
Finisher = Callable[[torch.Tensor], list[torch.Tensor]]
Rule = Callable[[nn.Module, "torch.Tensor | None", "torch.Tensor | None", Calls, int, torch.Tensor], Finisher]
# Unfolded inputs are formed for at most this many floats at a time (4 MiB), which then stay in cache.
CHUNK_FLOATS = 1 << 20
_CONV = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _opacus_layers() -> tuple[type[nn.Module], ...]:
    """The layer types Opacus writes for DP whose per-sample gradients its grad samplers form. A model holding
    one was built with Opacus imported, so a model without Opacus loaded holds none (and this imports nothing)."""
    if "opacus" not in sys.modules:
        return ()
    from opacus.layers.dp_rnn import RNNLinear

    return (RNNLinear,)


def handles(module: nn.Module) -> bool:
    """Whether a rule here clips this layer's parameters (convolutions: ungrouped, zero-padded, undilated)."""
    if isinstance(module, _CONV) and type(module) in _CONV:
        square = all(len(set(cast(tuple[int, ...], v))) == 1 for v in (module.kernel_size, module.stride,
                                                                        module.padding))
        return (module.groups == 1 and module.padding_mode == "zeros" and not isinstance(module.padding, str)
                and all(d == 1 for d in module.dilation) and square)
    if isinstance(module, nn.Embedding):  # nn.Embedding and the token-id one (fedbroker.layers.modules)
        return module.padding_idx is None and not module.sparse and module.max_norm is None
    return type(module) in _opacus_layers()


def own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters a module holds itself. Opacus's DPLSTM/DPGRU also list their cells' parameters
    under torch's names (weight_ih_l0); those are the cells', which the rules clip, so they count as none here."""
    if "opacus" in sys.modules:
        from opacus.layers.param_rename import RenameParamsMixin

        if isinstance(module, RenameParamsMixin):
            return []
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def unclippable(model: nn.Module, known: tuple[type[nn.Module], ...]) -> list[str]:
    """'name (Type)' of every layer holding trainable parameters that neither `known` (bk's own types) nor a rule
    here clips: the nodes a worker names when it refuses the model."""
    return [f"{name or 'the model'} ({type(m).__name__})" for name, m in model.named_modules()
            if own_parameters(m) and type(m) not in known and not handles(m)]


def rule(module: nn.Module) -> Rule:
    """The rule for a layer `handles` accepts."""
    if isinstance(module, _CONV):
        return cast(Rule, _conv_layer)
    if isinstance(module, nn.Embedding):
        return cast(Rule, _embedding_layer)
    return _sampled_layer


def _ghost_cheaper(positions: int, out_dim: int, in_dim: int) -> bool:
    """Two T×T Gram matrices (T²·(O+D) per sample) against the O×D per-sample gradient (T·O·D)."""
    return positions * (out_dim + in_dim) < out_dim * in_dim


def _unfold(x: torch.Tensor, dims: int, k: int, padding: int, stride: int) -> torch.Tensor:
    """(n, C, *spatial) → (n, C·k^dims, positions): the sliding blocks a convolution reads."""
    if dims == 1:
        return F.unfold(x.unsqueeze(2), (1, k), padding=(0, padding), stride=(1, stride))
    if dims == 2:
        return F.unfold(x, k, padding=padding, stride=stride)
    from opacus.utils.tensor_utils import unfold3d

    return cast(torch.Tensor, unfold3d(x, kernel_size=k, padding=padding, stride=stride))


def _conv_matrices(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, A) with the per-sample weight gradient G·Aᵀ: G (n, rows, T), A (n, columns, T), rows × columns
    being the weight's first axis by the rest."""
    conv = cast(nn.Conv1d, module)
    dims, k, pad, stride = len(conv.kernel_size), conv.kernel_size[0], cast(tuple[int, ...], conv.padding)[0], \
        conv.stride[0]
    if isinstance(module, nn.ConvTranspose2d | nn.ConvTranspose3d):
        return a.flatten(2), _unfold(g, dims, k, pad, stride)
    return g.flatten(2), _unfold(a, dims, k, pad, stride)


def _conv_weight_sum(module: nn.Module, shape: torch.Size, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Σ over the batch of the per-sample weight gradients (g already scaled per sample)."""
    conv = cast(nn.Conv1d, module)
    dims = len(conv.kernel_size)
    weight_grad = {1: nn_grad.conv1d_weight, 2: nn_grad.conv2d_weight, 3: nn_grad.conv3d_weight}[dims]
    if isinstance(module, nn.ConvTranspose2d | nn.ConvTranspose3d):  # the adjoint: input and gradient swap
        a, g = g, a
    total: torch.Tensor = weight_grad(a, shape, g, conv.stride, conv.padding, conv.dilation)  # type: ignore[no-untyped-call]
    return total


def _conv_layer(module: nn.Module, weight: torch.Tensor | None, bias: torch.Tensor | None, calls: Calls, n: int,
                norms2: torch.Tensor) -> Finisher:
    if not calls:  # the layer never reached the loss: every per-sample gradient is zero
        return lambda factor: [torch.zeros_like(p) for p in (weight, bias) if p is not None]
    shape = cast(torch.Tensor, module.weight).shape
    rows, columns = shape[0], math.prod(shape[1:])
    per_sample: list[torch.Tensor] = []
    if weight is not None:
        positions = sum(a[0].numel() // a.shape[1] if isinstance(module, nn.ConvTranspose2d | nn.ConvTranspose3d)
                        else g[0].numel() // g.shape[1] for a, g in calls)
        ghost = _ghost_cheaper(positions, rows, columns)
        step = max(1, CHUNK_FLOATS // max(1, positions * max(rows, columns)))
        for lo in range(0, n, step):
            parts = [_conv_matrices(module, a[lo:lo + step], g[lo:lo + step]) for a, g in calls]
            G = torch.cat([p[0] for p in parts], dim=2)
            A = torch.cat([p[1] for p in parts], dim=2)
            if ghost:
                gram = torch.bmm(G.transpose(1, 2), G).mul_(torch.bmm(A.transpose(1, 2), A))
                norms2[lo:lo + step] += gram.sum((1, 2))
            else:
                chunk = torch.bmm(G, A.transpose(1, 2)).flatten(1)
                norms2[lo:lo + step] += chunk.square().sum(1)
                per_sample.append(chunk)
    g_sum: torch.Tensor | None = None
    if bias is not None:
        g_sum = torch.stack([g.flatten(2).sum(2) for _, g in calls]).sum(0)
        norms2.add_(g_sum.square().sum(1))

    def finish(factor: torch.Tensor) -> list[torch.Tensor]:
        sums: list[torch.Tensor] = []
        if per_sample:
            sums.append(factor @ torch.cat(per_sample))
        elif weight is not None:
            total = torch.zeros_like(weight)
            for a, g in calls:
                total += _conv_weight_sum(module, shape, a, g * factor.view(-1, *[1] * (g.dim() - 1)))
            sums.append(total)
        if g_sum is not None:
            sums.append(factor @ g_sum)
        return sums
    return finish


def _embedding_layer(module: nn.Module, weight: torch.Tensor | None, bias: torch.Tensor | None, calls: Calls,
                     n: int, norms2: torch.Tensor) -> Finisher:
    assert weight is not None and bias is None  # an Embedding has one weight; `supported` lists it trained
    width = weight.shape[1]
    if not calls:
        return lambda factor: [torch.zeros_like(weight)]
    ids = torch.cat([a.reshape(n, -1).long() for a, _ in calls], dim=1)
    G = torch.cat([g.reshape(n, -1, width) for _, g in calls], dim=1)
    step = max(1, CHUNK_FLOATS // ids.shape[1] ** 2)  # T×T Gram matrices of `step` samples at a time
    for lo in range(0, n, step):
        chunk, g_chunk = ids[lo:lo + step], G[lo:lo + step]
        same = chunk.unsqueeze(2) == chunk.unsqueeze(1)
        norms2[lo:lo + step] += (torch.bmm(g_chunk, g_chunk.transpose(1, 2)) * same).sum((1, 2))

    def finish(factor: torch.Tensor) -> list[torch.Tensor]:
        scaled = (G * factor.view(-1, 1, 1)).reshape(-1, width)
        return [torch.zeros_like(weight).index_add_(0, ids.reshape(-1), scaled)]
    return finish


def _sampled_layer(module: nn.Module, weight: torch.Tensor | None, bias: torch.Tensor | None, calls: Calls,
                   n: int, norms2: torch.Tensor) -> Finisher:
    """A layer of Opacus's: its registered grad sampler on each call's (activation, output gradient)."""
    from opacus.grad_sample import GradSampleModule

    sampler = GradSampleModule.GRAD_SAMPLERS[type(module)]
    trained = [p for p in (weight, bias) if p is not None]
    sums: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for p in trained:  # the pass turned requires_grad off; the samplers form only the trained ones'
            p.requires_grad_(True)
        try:
            for a, g in calls:
                for p, grads in sampler(module, [a], g).items():
                    sums[id(p)] = grads if id(p) not in sums else sums[id(p)] + grads
        finally:
            for p in trained:
                p.requires_grad_(False)
    per_sample = [sums[id(p)].reshape(n, -1) if id(p) in sums else torch.zeros((n, p.numel()), dtype=p.dtype,
                                                                                device=p.device) for p in trained]
    for grads in per_sample:
        norms2.add_(grads.square().sum(1))
    return lambda factor: [factor @ grads for grads in per_sample]
