"""SmoothQuant (Xiao et al. 2023): move quantization difficulty from activations to weights.

A linear layer computes y = x W^T. For any positive per-input-channel vector s,

    y = (x / s) (W * s)^T          (x / s divides column j of x by s_j, W * s scales column j of W)

so dividing an outlier channel of the activations by a large s_j and multiplying the matching
weight column by it leaves the product unchanged, while the activation range shrinks. The
per-channel migration strength alpha in [0, 1] picks s between "all on activations" and
"all on weights":

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

With alpha = 1, every activation channel ends with absmax 1 (x / s is flat) and the weights
carry the range; with alpha = 0, every weight column ends with absmax 1. The paper uses
alpha = 0.5 for most models. In a pre-norm model, 1/s is folded into the previous LayerNorm's
gain and bias, so it costs nothing at run time.

Zero channels (qlab's convention): where max|X_j| = 0 or max|W_j| = 0 the channel adds
nothing to the product, and the formula would give 0, inf or NaN; s_j = 1 there (leave the
channel alone). The paper's code (mit-han-lab/smoothquant, smooth.py `smooth_ln_fcs`)
instead clamps the weight statistic max|W_j| (the largest over the linears that share the
LayerNorm) to >= 1e-5, and then the final s_j to >= 1e-5; the activation statistic is not
clamped.
"""

from __future__ import annotations

import torch

from qlab._tensor import as_float32

__all__ = ["smooth_scales", "weight_absmax"]


def _check_absmax(t: torch.Tensor, what: str) -> None:
    if t.ndim != 1:
        raise ValueError(f"{what} must be 1-d (one value per input channel), got shape "
                         f"{tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"{what} must be finite and >= 0 (an absolute maximum per channel)")


def weight_absmax(weight) -> torch.Tensor:
    """float32 (in_features,): max |W[:, j]| over output rows for a weight of shape (out, in)."""
    w = as_float32(weight, "weight")
    if w.ndim != 2:
        raise ValueError(f"weight must be (out_features, in_features), got {tuple(w.shape)}")
    return w.abs().amax(dim=0)


def smooth_scales(act_absmax, weight_absmax, alpha: float = 0.5) -> torch.Tensor:
    """float32 (K,): s_j = act_absmax_j^alpha / weight_absmax_j^(1 - alpha), and s_j = 1
    where either statistic is 0.

    act_absmax: (K,) max |x_j| over calibration tokens; weight_absmax: (K,) max |W[:, j]|
    (see ``weight_absmax``). Computed in float64, rounded to float32 once. Apply as x / s and
    W * s (W of shape (out, K), s broadcast over rows)."""
    a = as_float32(act_absmax, "act_absmax")
    w = as_float32(weight_absmax, "weight_absmax")
    _check_absmax(a, "act_absmax")
    _check_absmax(w, "weight_absmax")
    if a.shape != w.shape:
        raise ValueError(f"act_absmax {tuple(a.shape)} and weight_absmax {tuple(w.shape)} must "
                         "have one value per input channel each (same length)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    a64, w64 = a.double(), w.double()
    s = a64.pow(alpha) / w64.pow(1.0 - alpha)
    return torch.where((a64 == 0) | (w64 == 0), torch.ones_like(s), s).float()
