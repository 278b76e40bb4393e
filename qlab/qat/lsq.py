"""LSQ: learned step size quantization (Esser et al., ICLR 2020, "Learned Step Size
Quantization", arXiv:1902.08153). The scale s of a symmetric integer grid is a parameter
trained with the network.

    forward   u = x / s,  q = clamp(round(u), -Q, Q),  x_hat = q * s        (Q = 2^(b-1) - 1)
    backward  dx_hat/dx = 1 where -Q s <= x <= Q s, else 0           (the STE, as ste.py)
              dx_hat/ds = round(u) - u   where -Q s <= x <= Q s      (paper, eq. 3,
                                                                  with Q_N = Q_P = Q)
                        = -Q             where x < -Q s
                        = +Q             where x > +Q s
              dL/ds     = g * sum over the elements sharing s of dL/dx_hat * dx_hat/ds
              g         = 1 / sqrt(N * Q)                               (paper, section 2.2)

The paper's signed grid is not symmetric: -Q_N..Q_P with Q_N = 2^(b-1), Q_P = 2^(b-1) - 1
(int2: {-2, -1, 0, 1} * s), clamped-below gradient -Q_N, and Q_P in g and in the initial
step. qlab uses its symmetric grid -Q..Q (Q = Q_P) throughout.

round(u) - u is where LSQ differs from earlier learned-range methods (paper, Fig. 2): PACT's
gradient is 0 everywhere below the clip point, QIL's depends only on the distance from the
clip points; in LSQ a value close to a rounding transition pushes hardest on the step size.
N is the number of elements that share the scale: the layer's weight count for the paper's
one scale per layer, the group size for one scale per group, and for an activation (one
scale per layer input) the features of one example (the paper's N_F).
g keeps the step-size gradient on the scale of the weight gradients; it was derived for
SGD. With Adam, which divides each gradient by its own running RMS, a constant factor
on a parameter's gradient almost cancels: there, what sets the step size's speed is its
learning rate (qlab.qat.train gives the scales their own).

The range test is on x against the ends of the grid, -Q * s and Q * s (float32 products),
exactly as ste.py tests it. Boundary: x == +-Q * s exactly counts as INSIDE (gradient 1
for x; round(u) - u = 0 for s), as in torch's clamp autograd and LSQ's reference-style
code (clamp, then round with an STE, then times s); the paper's eq. 3 puts v/s = +-Q in
the clamped branch (dx_hat/ds = +-Q). Values exactly on the end of the grid are
measure-zero in training; this choice keeps x and s consistent with the STE of ste.py. A
scale of 0 (an all-zero group, as qlab's absmax rule gives it) divides by 1 instead, so
its elements quantize to 0 and pass their gradient.

Scales are stored like qlab's integer schemes, in fp16 (DESIGN.md): LSQQuantizer rounds
its float32 parameter to fp16 in the forward pass (straight through), so what training
sees is exactly what ``convert`` stores.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qlab.quantize import QTensor, quantize
from qlab.schemes import Granularity, Scheme, get_scheme, int_scheme

__all__ = ["lsq_fake_quantize", "lsq_grad_scale", "LSQQuantizer"]

FP16_MAX = torch.finfo(torch.float16).max  # 65504.0


def lsq_grad_scale(n_per_scale: int, qmax: int) -> float:
    """LSQ's gradient scale g = 1 / sqrt(N * Q) (paper, section 2.2)."""
    return 1.0 / math.sqrt(n_per_scale * qmax)


def _expand(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """scale () or x.shape[:-1] + (G,) -> broadcastable per element (groups of K / G)."""
    if scale.ndim == 0:
        return scale
    if scale.shape[:-1] != x.shape[:-1] or x.shape[-1] % scale.shape[-1]:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} does not fit x of shape {tuple(x.shape)}: "
            "use shape () for one scale, or x.shape[:-1] + (G,) with G dividing the last axis"
        )
    return scale.repeat_interleave(x.shape[-1] // scale.shape[-1], dim=-1)


def _reduce(per_element: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Sum per-element values over the elements that share each scale: -> scale's shape."""
    if scale.ndim == 0:
        return per_element.sum()
    k = per_element.shape[-1]
    groups = scale.shape[-1]
    # shape: (..., K) -> (..., G, K // G)
    return per_element.reshape(*per_element.shape[:-1], groups, k // groups).sum(dim=-1)


def _grid_values(x: torch.Tensor, s: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """u = x / s (true fp32 division; s == 0 divides by 1) and q = clamp(round(u), -Q, Q)
    (round half to even). s is already expanded to broadcast against x."""
    u = x / torch.where(s == 0, torch.ones_like(s), s)
    return u, torch.clamp(torch.round(u), -qmax, qmax)


class _LSQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, qmax: int, grad_scale: float):
        s = _expand(scale, x)
        u, q = _grid_values(x, s, qmax)
        inside = (x >= -qmax * s) & (x <= qmax * s)  # closed: the ends of the grid are inside
        ctx.save_for_backward(u, q, inside, scale)
        ctx.grad_scale = grad_scale
        return q * s

    @staticmethod
    def backward(ctx, grad_out):
        u, q, inside, scale = ctx.saved_tensors
        grad_x = torch.where(inside, grad_out, torch.zeros_like(grad_out))
        dq_ds = torch.where(inside, q - u, q)  # round(u) - u inside; -Q / +Q where clamped
        grad_s = ctx.grad_scale * _reduce(grad_out * dq_ds, scale)
        return grad_x, grad_s, None, None


def lsq_fake_quantize(x: torch.Tensor, scale: torch.Tensor, bits: int,
                      grad_scale: float) -> torch.Tensor:
    """LSQ fake quantization of x on the symmetric int{bits} grid with step ``scale``.

    x: float32 (..., K). scale: float32, () for one step, or x.shape[:-1] + (G,) for one
    step per group of K // G contiguous elements (G = 1: per row). Returns float32 like x:
    clamp(round(x / s), -Q, Q) * s. Gradients flow to x (STE) and to scale (LSQ, times
    grad_scale); see the module docstring for the formulas and the boundary convention.
    """
    if x.dtype != torch.float32 or scale.dtype != torch.float32:
        raise TypeError(f"lsq_fake_quantize computes in float32; got x {x.dtype}, scale "
                        f"{scale.dtype}: convert with .float()")
    qmax = int_scheme(bits).grid.qmax
    return _LSQ.apply(x, scale, qmax, float(grad_scale))


class LSQQuantizer(nn.Module):
    """A learned-step-size quantizer for weights (one step per tensor / row / group, started
    from qlab's absmax scales) or activations (one step per layer input, started from the
    first batch it sees, as in the paper: s = 2 * mean|x| / sqrt(Q)).

    scheme: a symmetric integer scheme ("int2" .. "int8"). granularity: "tensor",
    "channel" or a group size along the last axis. init: the weight (out, in) to take the
    initial steps from (qlab.quantize(init, scheme, granularity).scales, so that before any
    training the quantizer IS qlab's round-to-nearest), or None for an activation quantizer
    (granularity "tensor"; the leading axis of x is the batch).
    """

    def __init__(self, scheme: str | Scheme, granularity: Granularity = "tensor",
                 init: torch.Tensor | None = None) -> None:
        super().__init__()
        sch = get_scheme(scheme)
        if sch.scale_rule != "absmax" or sch.grid.kind != "int":
            raise ValueError(
                f"LSQ learns the step of a symmetric integer grid (int2 .. int8); {sch.name!r} "
                "is not one. Use qlab.qat.fake_quantize_ste for NF4, FP8, MX and NVFP4"
            )
        self.scheme, self.granularity, self.qmax = sch, granularity, sch.grid.qmax
        self.is_activation = init is None
        if self.is_activation:
            if granularity != "tensor":
                raise ValueError("an activation LSQ quantizer (init=None) has one scale per "
                                 f"tensor; got granularity {granularity!r}")
            self.scale = nn.Parameter(torch.zeros(()))
        else:
            self.scale = nn.Parameter(quantize(init, sch, granularity).scales.float())
        self.register_buffer("initialized", torch.tensor(not self.is_activation))

    def n_per_scale(self, x: torch.Tensor) -> int:
        """N of g = 1 / sqrt(N * Q): the elements sharing one scale (for an activation
        quantizer, the features of one example)."""
        if self.is_activation and x.ndim > 1:
            return x[0].numel()
        return x.numel() // self.scale.numel()

    def stored_scale(self) -> torch.Tensor:
        """The step as stored and used: |scale| rounded to the scheme's scale dtype (fp16),
        straight through (the rounding is invisible to the gradient)."""
        s = self.scale.abs()
        stored = s.to(self.scheme.scale_dtype).float()
        if bool(torch.isinf(stored).any()):
            raise ValueError(f"a learned scale exceeds the fp16 range ({FP16_MAX:g}); lower "
                             "the learning rate of the scales")
        return s + (stored - s).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not bool(self.initialized):
            self._init_from(x)
        g = lsq_grad_scale(self.n_per_scale(x), self.qmax)
        y = lsq_fake_quantize(x.float(), self.stored_scale(), self.scheme.grid.bits, g)
        return y.to(x.dtype)

    @torch.no_grad()
    def _init_from(self, x: torch.Tensor) -> None:
        self.scale.copy_(2 * x.abs().mean() / math.sqrt(self.qmax))
        self.initialized.fill_(True)

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> QTensor:
        """The QTensor of x under the current step: int8 codes, fp16 scales (so that
        qt.dequantize() equals this quantizer's forward, bit for bit)."""
        if not bool(self.initialized):
            raise RuntimeError("this activation quantizer has not seen a batch yet; run the "
                               "model once (its first batch sets the step)")
        s = self.stored_scale().detach()
        _, q = _grid_values(x.detach().float(), _expand(s, x), self.qmax)
        return QTensor(codes=q.to(torch.int8), scales=s.to(self.scheme.scale_dtype),
                       zero_points=None, scheme=self.scheme, granularity=self.granularity)
