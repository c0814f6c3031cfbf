"""How DP training clips per-sample gradients: the three modes, which one a model gets, and the wrapping of
the model and its optimizer for each.

Three clipping modes, one mechanism (`clipping_mode` picks per model and expected batch, logged and
reported as `TrainResult.clipping`). "bk" (book-keeping, `fedbroker.worker.one_pass_clipping`, ours): one
forward and one backward pass with the parameters' requires_grad off, so autograd forms no weight
gradient; hooks keep each layer's input a and output gradient g, from which come the per-sample norms
(Linear: ‖g_i‖·‖a_i‖; Conv2d: ghost norm or per-sample gradient, whichever is cheaper per layer;
GroupNorm/LayerNorm: per-sample gradients) and then the clipped sum, one product per layer;
`FlatSumDPOptimizer` noises it. "ew" forms every per-sample gradient (torch's ExpandedWeights
through Opacus, `GRAD_SAMPLE_MODE`; "hooks" and "functorch" give the same gradients, slower) and
`FlatDPOptimizer` clips them. "ghost" is Opacus's fast gradient clipping
(`GradSampleModuleFastGradientClipping` + `DPLossFastGradientClipping`): per-sample norms from a
first backward pass, Linear layers' without forming their per-sample gradients, then a second
backward pass of Σ_i c_i·loss_i with c_i = min(1, C/(‖g_i‖+1e-6)), which leaves the clipped sum
in .grad. All three then add the same N(0, (σC)²) noise and divide by the expected batch: the
released update is the same function of the batch (tests check each against Opacus's materialised
per-sample clipping with the noise off; "bk" on five models with residual connections,
shared and frozen layers and in-place activations), so the accountant's ε is the same.

"bk" is chosen wherever it runs: two bench runs of this code (2026-11-25, 2 shared cores, 1 torch thread),
batch 32: MLP 64-64-10 1.63–1.68× (ew 2.5–4.1×), small CNN 1.83–1.85× (ew 2.0–2.1×), ResNet-style
CNN 1.37–1.50× (ew 2.2–2.4×); ResNet at 256 1.26–1.34× (ew 1.8–1.9×). Before it, "ghost" paid only
where "ew" would form many per-sample floats: MLP 64-64-10 ghost 4.5× against ew 3.3× at batch
32, 2.3× against 3.3× at 256; a 784-256-10 MLP 4.7× against 9.5× at 32. Opacus has no norm
sampler for Conv2d, so for CNNs "ghost" forms the per-sample gradients layer by layer and adds
a backward pass (ResNet-style CNN 4.6–5.1× against ew's 2.7×).

"ew" backpropagates the summed loss: ExpandedWeights' per-sample gradients of a mean loss are
rescaled by the batch size, one more pass over batch × parameters floats (ResNet-style CNN, batch
64: 4.2× → 2.7×).

What remains per step at batch 32, measured with a profiler: the per-sample norms and clipped sums
(MLP: about 20 small tensor operations, 75 µs of a 400 µs step against 235 µs without DP; small
CNN: unfolding the convolutions' inputs and the ghost layer's weight gradient, ~40% of its step),
the noise (20 µs for the MLP's 4,810 parameters) and Opacus's step around it. The MLP's slowdown no
longer grows with the batch (1.55× at 512 in both runs).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from torch import nn

from fedbroker.errors import ConfigError
from fedbroker.worker import layer_clipping, one_pass_clipping

if TYPE_CHECKING:  # named for the type checker only: importing them imports Opacus, which waits for a DP training
    from fedbroker.worker.dp_optimizer import FlatDPOptimizer, FlatGhostDPOptimizer, FlatSumDPOptimizer

    DPOptimizer = FlatDPOptimizer | FlatGhostDPOptimizer | FlatSumDPOptimizer

_Optimizer = TypeVar("_Optimizer", bound="DPOptimizer")

GRAD_SAMPLE_MODE = "ew"
# Layers whose per-sample gradients torch's ExpandedWeights forms. A model with a trainable parameter elsewhere (a
# library network's ConvTranspose or PReLU, a ViT's class token) gets Opacus's "hooks" mode instead, whose
# samplers fall back to torch.func for a module they do not know: slower, the same gradients.
EW_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.GroupNorm, nn.LayerNorm,
             nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
CLIPPING_MODES = ("auto", "bk", "ghost", "ew")
# "ghost" (for models "bk" cannot clip): layers Opacus's fast gradient clipping handles with its own samplers (norms of Linear's per-sample
# gradients without forming them; Conv2d's and GroupNorm's formed one layer at a time and dropped).
GHOST_LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm)
# "ghost" pays once "ew" would form this many per-sample gradient floats of Linear layers per step
# (expected batch × Linear parameters); below it, its second backward pass and hooks cost more.
GHOST_MIN_FLOATS = 1 << 20

Backward = Callable[[torch.Tensor, torch.Tensor], float]

# Opacus's per-sample hooks (mode "hooks") make torch warn once per process that inputs need no
# gradient; that is expected here and says nothing to a data owner. Only this message is silenced.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed", category=UserWarning)


class Hooked(Protocol):
    """A model wrapped for per-sample clipping, whose hooks must come off once training ends."""

    def cleanup(self) -> None:
        """Remove the hooks and per-sample attributes from the wrapped model."""


def clipping_mode(model: nn.Module, *, expected_batch_size: int) -> str:
    """How DP training clips `model`'s per-sample gradients at `expected_batch_size`: "bk", "ghost" or "ew".

    "bk" (`fedbroker.worker.one_pass_clipping`) wherever it runs: every trained parameter in an unshared
    Linear, Conv2d (ungrouped, zero-padded), GroupNorm or LayerNorm layer, or in a layer of
    `fedbroker.worker.layer_clipping` (Conv1d/3d, ConvTranspose2d/3d, Embedding, Opacus's DPLSTM/DPGRU
    cells); it is the fastest of the three on every model and batch the bench measures. Otherwise "ghost", Opacus's fast gradient
    clipping, where it runs and pays: every parameter in an unshared Linear, Conv2d or GroupNorm
    layer, and at least GHOST_MIN_FLOATS per-sample Linear gradient floats per step that "ew" would
    form; else "ew" (per-sample gradients formed by torch's ExpandedWeights through Opacus). All three
    give the same clipped sum.
    """
    if one_pass_clipping.supported(model):
        return "bk"
    if not ghost_supported(model):
        return "ew"
    linear = sum(p.numel() for m in model.modules() if type(m) is nn.Linear for p in m.parameters() if p.requires_grad)
    return "ghost" if expected_batch_size * linear >= GHOST_MIN_FLOATS else "ew"


def ghost_supported(model: nn.Module) -> bool:
    """True when every trainable parameter sits in an unshared Linear, Conv2d or GroupNorm layer
    (Opacus's fast gradient clipping refuses tied parameters and has no samplers for other layers)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if any(p.requires_grad for p in own) and type(module) not in GHOST_LAYERS:
            return False
        for p in own:
            owners[id(p)] = owners.get(id(p), 0) + 1
    return all(count == 1 for count in owners.values())


def grad_sample_mode(model: nn.Module) -> str:
    """Opacus's per-sample mode for "ew" clipping: GRAD_SAMPLE_MODE where ExpandedWeights knows every trained
    layer (EW_LAYERS), else "hooks"."""
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)) and type(module) not in EW_LAYERS:
            return "hooks"
    return GRAD_SAMPLE_MODE


def check_supported(model: nn.Module, mode: str) -> None:
    """Refuse, before any step, a clipping mode asked for a model it cannot clip."""
    if mode == "bk" and not one_pass_clipping.supported(model):
        nodes = layer_clipping.unclippable(model, one_pass_clipping.LAYERS)
        raise ConfigError("clipping", "bk clipping cannot clip "
                          + (f"the layers {', '.join(nodes)}" if nodes else "a parameter shared by two layers")
                          + ": it needs every parameter in one unshared layer of "
                          f"{', '.join(t.__name__ for t in one_pass_clipping.LAYERS)} (convolutions ungrouped, "
                          "zero-padded), Conv1d/3d, ConvTranspose2d/3d (undilated), Embedding or an Opacus DP layer")
    if mode == "ghost" and not ghost_supported(model):
        raise ConfigError("clipping", "ghost clipping needs a model whose parameters all sit in unshared "
                          f"{', '.join(t.__name__ for t in GHOST_LAYERS)} layers")


PerSampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (output, target) -> (n,)


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target, reduction="none")


def dp_engine(
    work: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    clipping: str,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: int,
    generator: torch.Generator | None,
    loss: PerSampleLoss | None = None,
) -> tuple[Hooked, DPOptimizer, Backward]:
    """The wrapping of `work` for `clipping` ("bk", "ghost" or "ew"): (wrapped module, DP optimizer, backward).

    `backward(x, y)` runs the forward and backward passes of one (physical) batch and returns its mean
    loss; afterwards the optimizer's `step` clips (ew), noises and averages. `wrapped.cleanup()` removes
    the hooks. `loss(output, target)` is the task's loss per sample, shape (n,) (`fedbroker.tasks.losses`; default
    cross-entropy): each mode reduces it over the batch, so one sample's gradient is that of its own loss. What
    `train_local` runs,
    exposed so that tests can switch the noise off, which a DPPolicy never allows.
    """
    from opacus.grad_sample import GradSampleModuleFastGradientClipping, prepare_module
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    from fedbroker.worker.dp_optimizer import FlatDPOptimizer, FlatGhostDPOptimizer, FlatSumDPOptimizer

    def noised(cls: type[_Optimizer], **kwargs: str) -> _Optimizer:
        return cls(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                   expected_batch_size=expected_batch_size, generator=generator, **kwargs)

    per_sample = loss or _cross_entropy
    if clipping == "bk":
        sum_optimizer = noised(FlatSumDPOptimizer, loss_reduction="mean")
        clipper = one_pass_clipping.BookkeepingClipper(work, max_grad_norm=max_grad_norm, params=sum_optimizer.params,
                                                       loss=per_sample)
        sum_optimizer.source = clipper.take_clipped_sum
        return clipper, sum_optimizer, clipper.backward
    if clipping == "ghost":
        wrapped = GradSampleModuleFastGradientClipping(work, batch_first=True, loss_reduction="mean",
                                                       max_grad_norm=max_grad_norm, use_ghost_clipping=True)
        dp_optimizer = noised(FlatGhostDPOptimizer, loss_reduction="mean")
        # Opacus's per-sample loss tensor: backward() takes the per-sample norms, then backpropagates each
        # sample's loss times its clip factor, leaving the sum of clipped per-sample gradients in .grad.

        def backward(xb: torch.Tensor, yb: torch.Tensor) -> float:
            each = DPTensorFastGradientClipping(wrapped, dp_optimizer, per_sample(wrapped(xb), yb), "mean")
            each.backward()
            return float(each.detach())
    elif clipping == "ew":
        if all(p.device.type == "cpu" for p in work.parameters()):
            _unfold_per_sample_conv()
        # The summed loss's per-sample gradients are the per-sample gradients themselves; the mean loss's
        # would be multiplied back by the batch size, one more pass over batch × parameters floats.
        # FlatDPOptimizer averages by the expected batch size either way.
        wrapped = prepare_module(work, grad_sample_mode=grad_sample_mode(work), batch_first=True, loss_reduction="sum")
        wrapped.forbid_grad_accumulation()
        dp_optimizer = noised(FlatDPOptimizer)

        def backward(xb: torch.Tensor, yb: torch.Tensor) -> float:
            summed = per_sample(wrapped(xb), yb).sum()
            summed.backward()
            return float(summed.detach()) / len(yb)
    else:
        raise ConfigError("clipping", f"must be bk, ghost or ew, got {clipping!r}")
    return wrapped, dp_optimizer, backward


def _unfold_per_sample_conv() -> None:
    """Make ExpandedWeights form Conv2d's per-sample gradients by unfold + batched matmul at every batch size.

    Below a batch of 32 (its private `THRESHOLD`) torch switches to one grouped convolution over the
    batch, which on CPU ran the ResNet-style CNN at batch 32 at 3.7× the time of training without DP
    against 2.3× (small CNN 2.0× against 1.8×): a Poisson batch of expected size 32 is below 32 about
    half the time. Both give the same gradients. Process-wide, set only when training on CPU (the GPU
    case is unmeasured); if torch renames the constant, nothing changes.
    """
    from torch.nn.utils._expanded_weights import conv_utils

    if isinstance(getattr(conv_utils, "THRESHOLD", None), int):
        conv_utils.THRESHOLD = 0
