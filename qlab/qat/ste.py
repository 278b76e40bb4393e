"""The straight-through estimator (STE): fake quantization that training can see through.

Rounding is a staircase: its derivative is 0 almost everywhere and undefined at the steps,
so backpropagating through ``qlab.fake_quantize`` teaches a model nothing. The STE
(Bengio et al. 2013) keeps the exact forward and pretends, in the backward pass only, that
rounding was the identity; the clamp at the ends of the grid stays a clamp:

    forward   x_hat = qlab.fake_quantize(x, scheme, granularity)           (bit-identical)
    backward  dL/dx = dL/dx_hat   where lo <= x <= hi
              dL/dx = 0           where x < lo or x > hi      (x was clamped / saturated)

Convention. [lo, hi] is the representable range of x's group: the smallest and largest
values the group can take, i.e. the grid's two end codes dequantized with that group's
scale (and zero point, tensor scale): [-qmax * s, qmax * s] for int{b} with its fp16 s,
[(0 - z) * s, (2^b - 1 - z) * s] for asymmetric ints, [-max * s, max * s] for minifloats.
It is computed by qlab.dequantize itself, so it holds for every scale rule as written.
The interval is CLOSED: x exactly at an end (e.g. the largest |x| of a group whose fp16
scale absmax / qmax is exact) is representable, comes back exactly, and keeps its
gradient. This is torch's autograd of ``clamp(x, lo, hi)`` with the rounding replaced by
the identity, and what LSQ's reference-style code does (see lsq.py). An all-zero group
has lo = hi = 0 and passes its gradient.

Consequences worth knowing:
- With a scale computed from the data (absmax), clamping is rare: the largest element of
  a group sits at the end of the grid by construction. It is clamped only when the stored
  fp16 scale rounded DOWN (absmax = qmax * s * (1 + ~1e-4)): then it lies beyond hi and
  gets no gradient. MX scales are powers of two, so up to the top binade of a block
  saturates (MXFP4: |x / X| in (6, 8)) and really is clamped. NF4 never clamps, except
  with double quantization, whose stored absmax can land a hair below the true one.
- The alternative convention (torch.fake_quantize_per_tensor_affine) masks on the ROUNDED
  code instead, so values up to half a step beyond the grid still pass; it has no
  natural meaning for minifloats, whose saturation is not an integer clamp.
- The gradient does not flow into the scale here (it is a function of x through absmax,
  treated as a constant). To learn the scale, use LSQ (qlab.qat.lsq).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from qlab.quantize import QTensor, dequantize, quantize
from qlab.schemes import Granularity, Scheme

__all__ = ["fake_quantize_ste", "representable_mask", "representable_range"]


def representable_range(qt: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi), float32 tensors of qt's shape: the smallest and largest value the group of
    each element can represent, from qlab.dequantize of the grid's two end codes."""
    values = qt.scheme.grid.values
    ends = []
    for v in (values[0], values[-1]):
        code = qt.scheme.grid.encode(v.reshape(1))  # the end code, in the grid's code dtype
        codes = torch.full_like(qt.codes, int(code[0]))
        ends.append(dequantize(replace(qt, codes=codes)))
    return torch.minimum(*ends), torch.maximum(*ends)  # a negative scale swaps the ends


def representable_mask(x: torch.Tensor, qt: QTensor) -> torch.Tensor:
    """bool, x's shape: True where x lies inside the closed representable range of its
    group (the gradient passes), False where quantization clamped or saturated it.
    ``qt`` is ``qlab.quantize(x, ...)``; see the module docstring for the convention."""
    lo, hi = representable_range(qt)
    x = x.detach().to(device="cpu", dtype=torch.float32)
    return (x >= lo) & (x <= hi)


class _FakeQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scheme, granularity):
        qt = quantize(x, scheme, granularity)
        ctx.save_for_backward(representable_mask(x, qt).to(x.device))
        return dequantize(qt).to(device=x.device, dtype=x.dtype)  # = qlab.fake_quantize

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (inside,) = ctx.saved_tensors
        return torch.where(inside, grad_out, torch.zeros_like(grad_out)), None, None


def fake_quantize_ste(
    x: torch.Tensor, scheme: str | Scheme, granularity: Granularity | None = None
) -> torch.Tensor:
    """qlab.fake_quantize(x, scheme, granularity) with a straight-through gradient.

    x: float tensor (any shape; fp16/bf16/fp32, any device: qlab computes on the CPU in fp32
    and returns x's dtype and device). Forward: bit-identical to qlab.fake_quantize.
    Backward: dL/dx passes unchanged where x is inside the representable range of its
    group (the ends included) and is 0 where it was clamped (``representable_mask``).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            "fake_quantize_ste takes a floating-point torch tensor (it is for training); "
            f"got {type(x).__name__}{'' if not isinstance(x, torch.Tensor) else ' ' + str(x.dtype)}"
        )
    return _FakeQuantizeSTE.apply(x, scheme, granularity)
