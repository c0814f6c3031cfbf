"""The privacy-critical step of DP-SGD: Opacus's mechanism (clip, sum, noise, average) on one flat vector.

Importing this module imports Opacus (seconds); `fedbroker.worker.clipping` imports it only when a
DP training starts, so a process that only evaluates never pays for it.

Measured in CPU time (1 torch thread, digits, batch 32, SGD, grad-sample mode "hooks"; slowdown
against no DP for the MLP 64-64-10 and a small CNN with GroupNorm), both with the trainer's bulk
Poisson sampling and ε computed once: Opacus's DPOptimizer 4.1× and 3.1×, `FlatDPOptimizer` 3.6× and
2.9×. `python -m bench --only dp_training` has the table.

Three optimizers, one per clipping mode of the trainer, share the flat noise and averaging:
`FlatDPOptimizer` clips materialised per-sample gradients (Opacus's DPOptimizer, mode "ew"),
`FlatGhostDPOptimizer` receives the sum of clipped per-sample gradients that Opacus's fast gradient
clipping formed by a second backward pass (Opacus's DPOptimizerFastGradientClipping, "ghost"), and
`FlatSumDPOptimizer` receives that sum as one flat vector from `fedbroker.worker.one_pass_clipping` ("bk").
All accumulate virtual steps (a Poisson batch trained in several physical chunks, `signal_skip_step`)
into one sum, noised once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed


class _FlatNoise:
    """Noise and averaging on one flat vector, and the accumulation of virtual steps into it.

    `_flat_sum` plays the part of Opacus's `p.summed_grad`: kept across `zero_grad` while the last
    step was skipped (a virtual step), dropped otherwise, and marked processed once noised, so a
    sum is never noised and released twice.
    """

    _flat_sum: torch.Tensor | None = None
    _flat_grad: torch.Tensor
    _is_last_step_skipped: bool
    expected_batch_size: int
    generator: torch.Generator | None
    max_grad_norm: float
    noise_multiplier: float
    params: list[Any]  # Opacus's DPOptimizer property, which every subclass also derives from

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        if not self._is_last_step_skipped:
            self._flat_sum = None

    @property
    def accumulated_iterations(self) -> int:
        # The accountant multiplies the sample rate by this: a Poisson batch is one draw at rate q however
        # many physical chunks (virtual steps) it is trained in.
        return 1

    def _accumulate(self, chunk_sum: torch.Tensor) -> None:
        if self._flat_sum is None:
            self._flat_sum = chunk_sum
        else:
            _check_processed_flag(self._flat_sum)  # stepping again without zero_grad: never a second release
            self._flat_sum = self._flat_sum + chunk_sum

    def add_noise(self) -> None:
        summed = self._flat_sum
        if summed is None:
            raise ValueError("no clipped gradient to noise: call backward (or step on an empty batch) first")
        _check_processed_flag(summed)
        # summed + N(0, (σC)²) per coordinate, drawn in one operation (the same values as drawing the noise
        # from the generator and adding it)
        self._flat_grad = torch.normal(summed, self.noise_multiplier * self.max_grad_norm, generator=self.generator)
        _mark_as_processed(summed)
        params = self.params
        for p, g in zip(params, self._flat_grad.split([p.numel() for p in params])):
            p.grad = g.view(p.shape)

    def scale_grad(self) -> None:
        self._flat_grad /= self.expected_batch_size  # the parameters' .grad are views of it


class FlatDPOptimizer(_FlatNoise, DPOptimizer):  # type: ignore[misc]  # Opacus ships no type information
    """Opacus's DPOptimizer with clipping, noising and averaging done on one flat vector.

    The mechanism is Opacus's, unchanged: each sample's gradient over all parameters is scaled by
    min(1, C / (‖g‖ + 1e-6)), the scaled gradients are summed, every coordinate gets N(0, (σ·C)²)
    noise and the result is divided by the expected batch size. Opacus's phases each loop over
    the parameters, rebuilding the parameter list several times and drawing noise per parameter,
    which for the small models workers train costs more than the arithmetic. Here each
    parameter costs one norm and one matrix-vector product (no copy of the n·P per-sample
    gradients), and noise and averaging are one operation each on a flat vector.
    """

    def clip_and_accumulate(self) -> None:
        """Clip each sample's gradient to `max_grad_norm` and add their sum to the flat sum (Opacus's hook)."""
        grad_samples = self.grad_samples
        for p in self.params:
            p.grad_sample = None  # consumed: stepping again without a new backward pass raises
        n = len(grad_samples[0])
        flat = [g.reshape(n, math.prod(g.shape[1:])) for g in grad_samples]  # views: no copy of n·P floats
        per_param = torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat], dim=1)
        norms = torch.linalg.vector_norm(per_param, dim=1)
        factor = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        self._accumulate(torch.cat([factor @ f for f in flat]))  # zeros for an empty batch


class FlatGhostDPOptimizer(_FlatNoise, DPOptimizerFastGradientClipping):  # type: ignore[misc]
    """Opacus's DPOptimizerFastGradientClipping with noising and averaging done on one flat vector.

    Under fast gradient clipping (`opacus.utils.fast_gradient_clipping_utils.DPLossFastGradientClipping`)
    `p.grad` already holds Σ_i min(1, C / (‖g_i‖ + 1e-6))·g_i, formed by Opacus's second backward pass
    with the per-sample norms of its first: the same clipped sum `FlatDPOptimizer` forms from
    materialised per-sample gradients. What follows is the same noise and averaging. A parameter
    without a gradient (an empty Poisson batch, which has no forward pass) contributes zeros.
    """

    def accumulate(self) -> None:
        """Add the clipped sum Opacus's second backward pass left in .grad to the flat sum (Opacus's hook)."""
        self._accumulate(torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params
        ]))


class FlatSumDPOptimizer(_FlatNoise, DPOptimizerFastGradientClipping):  # type: ignore[misc]
    """Opacus's DPOptimizerFastGradientClipping fed the clipped sum as one flat vector.

    `source` (set by the trainer) returns the sum of clipped per-sample gradients that the last backward
    pass formed (`fedbroker.worker.one_pass_clipping`), flat in the order of `params`, once; None when no
    backward pass ran (an empty Poisson batch), which contributes zeros. What follows is the same noise
    and averaging as in `FlatDPOptimizer`.
    """

    source: Callable[[], torch.Tensor | None] = staticmethod(lambda: None)
    _buffer: torch.Tensor | None = None

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Drop the flat sum unless the last step was virtual; the parameters' .grad views stay."""
        # Nothing writes a parameter's .grad on this path but `add_noise`, which overwrites all of it, so the
        # .grad views of the last noised gradient stay (Opacus's loops over `summed_grad` and .grad: skipped).
        if not self._is_last_step_skipped:
            self._flat_sum = None

    def add_noise(self) -> None:
        """The noise of `_FlatNoise.add_noise`, drawn into one buffer of which the parameters' .grad are views,
        set once (assigning .grad costs more per parameter than the arithmetic of a small model's step)."""
        summed = self._flat_sum
        if summed is None:
            raise ValueError("no clipped gradient to noise: call backward (or step on an empty batch) first")
        _check_processed_flag(summed)
        params = self.params
        if self._buffer is None or self._buffer.shape != summed.shape or self._buffer.device != summed.device:
            self._buffer = torch.empty_like(summed)
        buffer = self._buffer
        torch.normal(summed, self.noise_multiplier * self.max_grad_norm, generator=self.generator, out=buffer)
        _mark_as_processed(summed)
        self._flat_grad = buffer
        offset = 0
        for p in params:
            size = p.numel()
            grad = p.grad
            if grad is None or grad.data_ptr() != buffer.data_ptr() + offset * buffer.element_size():
                p.grad = buffer[offset : offset + size].view(p.shape)
            offset += size

    def accumulate(self) -> None:
        """Add the clipped sum `source` hands over (zeros without a backward pass) to the flat sum (Opacus's hook)."""
        flat = self.source()
        if flat is None:
            params = self.params
            flat = torch.zeros(sum(p.numel() for p in params), device=params[0].device, dtype=params[0].dtype)
        self._accumulate(flat)
