"""AWQ: activation-aware weight quantization (Lin et al. 2024, "AWQ: Activation-aware
Weight Quantization for LLM Compression and Acceleration", section 3).

A few input channels carry much larger activations than the rest; the weights that
multiply them ("salient" weights) matter most for the output. AWQ protects them without
mixed precision: scale input channel k of W up by s_k before quantizing and divide the
activation by s_k (folded into the previous LayerNorm or linear at deployment),

    y = (x / s) @ Q(W * s)^T        instead of        y = x @ Q(W)^T

so the salient weights use more of the grid and lose less to rounding. The scales come
from a one-parameter search on calibration inputs (reference: llm-awq,
awq/quantize/auto_scale.py ``_search_module_scale``), whose conventions this follows:

    s(alpha) = mean_n |x_nk| ^ alpha, clamped to >= 1e-4, divided by sqrt(max s * min s)
    alpha in {0, 1/n_grid, ..., (n_grid - 1)/n_grid}   (20 points, 1.0 excluded)
    objective: mean((x W^T - x (Q(W * s) / s)^T)^2), the first smallest alpha wins

One difference: qlab scores one linear layer's output with its own s; the reference searches
one s for all the linears that read the same input (q, k and v) and scores the output of the
block they feed (module2inspect: the whole attention for q, k and v). alpha = 0 gives s = 1
exactly, i.e. RTN, so the result is never worse than RTN on the calibration objective (on
other data, or on the model's output, it can be). The optional clipping search
(auto_clip.py) is ``awq_clip``, a separate step applied to the scaled weight before it is
quantized.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qlab._tensor import torch_threads
from qlab.ptq.gptq import _check_group, _int_scheme, _work, hessian, layer_error
from qlab.quantize import QTensor, fake_quantize, quantize

__all__ = ["act_mean_abs", "awq_scales", "awq_weight", "awq_search", "awq", "awq_clip",
           "AWQSearch"]

SCALE_FLOOR = 1e-4  # reference: x_max.pow(ratio).clamp(min=1e-4); dead channels get it
N_GRID = 20  # reference: n_grid = 20, alpha = i / 20 for i in 0..19


def act_mean_abs(x) -> torch.Tensor:
    """mean |x| per input channel over every sample: float32 (K,) from x (..., K)
    (reference: get_act_scale, x.abs().view(-1, K).mean(0))."""
    x = _work(x, "x_calib").float()
    if x.ndim == 0 or x.numel() == 0:
        raise ValueError("x_calib must hold at least one sample of shape (..., K)")
    return x.reshape(-1, x.shape[-1]).abs().mean(dim=0)


def awq_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean_abs ^ alpha, clamped to >= 1e-4, normalised by sqrt(max(s) * min(s)):
    float32 (K,). The normalisation centres s around 1 on a log scale (max * min = 1), so
    W * s stays in the same range as W; the clamp keeps dead channels (mean |x| = 0)
    from giving a zero scale and a division by zero."""
    s = mean_abs.float().pow(alpha).clamp(min=SCALE_FLOOR)
    return s / (s.max() * s.min()).sqrt()


def awq_weight(weight, s: torch.Tensor, scheme="int4", group_size: int | None = 128):
    """What the layer computes with after AWQ: Q(W * s) / s, float32 (N, K); applying it
    to x equals applying Q(W * s) to x / s (reference: w_quantize_func(W * s) / s)."""
    w = weight if isinstance(weight, torch.Tensor) else torch.as_tensor(weight)
    gran = "channel" if group_size is None else group_size
    return fake_quantize(w.float() * s[None, :], _int_scheme(scheme), gran) / s[None, :]


class AWQSearch(NamedTuple):
    """One layer's scale search: every alpha tried, its objective, the winner."""

    alphas: list[float]
    errors: list[float]  # mean((x W^T - x W_hat^T)^2) per alpha
    best_alpha: float
    scales: torch.Tensor  # float32 (K,), s at best_alpha


def awq_search(weight, x_calib, scheme="int4", group_size: int | None = 128,
               n_grid: int = N_GRID) -> AWQSearch:
    """Try alpha = i / n_grid for i = 0..n_grid-1; keep the first with the smallest output
    error (strictly smaller wins, as in the reference, so ties keep the smaller alpha)."""
    w = _work(weight, "weight").float()
    if w.ndim != 2:
        raise ValueError(f"weight must be (N, K) like nn.Linear.weight, got {tuple(w.shape)}")
    x = _work(x_calib, "x_calib")
    if x.ndim == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"x_calib has {x.shape[-1] if x.ndim else 0} features per sample but the weight "
            f"has K = {w.shape[1]}; pass this layer's inputs, shape (..., K)"
        )
    _check_group(group_size, w.shape[1])
    if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
        raise ValueError(f"n_grid must be a positive int (20 in the reference), got {n_grid!r}")
    h = hessian(x).double()  # the objective from 2 X^T X / n: one (K, K) product per alpha
    mean_abs = act_mean_abs(x)
    alphas = [i / n_grid for i in range(n_grid)]
    errors, best = [], 0
    with torch_threads(1):  # small ops: one thread is faster (see qlab._tensor)
        for i, alpha in enumerate(alphas):
            w_hat = awq_weight(w, awq_scales(mean_abs, alpha), scheme, group_size)
            errors.append(layer_error(w, w_hat, h))
            if errors[i] < errors[best]:
                best = i
    return AWQSearch(alphas, errors, alphas[best], awq_scales(mean_abs, alphas[best]))


def awq(weight, x_calib, scheme="int4", group_size: int | None = 128,
        n_grid: int = N_GRID) -> tuple[QTensor, torch.Tensor]:
    """AWQ for one linear layer: weight (N, K), x_calib its calibration inputs (..., K).

    Returns (qt, s): qt is an ordinary QTensor of the SCALED weight W * s (any qlab integer
    scheme, group scales by the scheme's rule), s float32 (K,) the input scales, so that
    y ~= (x / s) @ qt.dequantize().T. Fold 1 / s into whatever produces x (the previous
    LayerNorm's gain and bias, or the previous linear's output rows)."""
    search = awq_search(weight, x_calib, scheme, group_size, n_grid)
    w = _work(weight, "weight").float() * search.scales[None, :]
    gran = "channel" if group_size is None else group_size
    return quantize(w, _int_scheme(scheme), gran), search.scales


def awq_clip(weight, x_calib, scheme="int4", group_size: int = 128, n_grid: int = N_GRID,
             max_shrink: float = 0.5, n_tokens: int = 512) -> torch.Tensor:
    """Optional second AWQ step (reference: auto_clip.py ``auto_clip_layer``): per group,
    clip the weights to +-m * absmax, m in {1, 1 - 1/n_grid, ..., > 1 - max_shrink}, keeping
    the m with the smallest error of that group's partial outputs x_g @ w_g^T on n_tokens
    evenly spaced samples. Returns the clipped weight (N, K), float32, to be quantized
    next. A smaller range rounds the bulk of the weights more finely at the price of the
    clipped few.

    After the scale search, pass the scaled pair: weight = W * s and x_calib = x / s (each
    column j of x divided by s_j), so that x_g @ w_g^T are the layer's true partial outputs.
    The reference does the same: llm-awq's apply_scale divides the cached input features by
    s ("prepare it for clipping") before auto_clip runs. Passing the unscaled x with W * s
    scores the clip on the wrong outputs."""
    w = _work(weight, "weight").float()
    g = _check_group(group_size, w.shape[1])
    x = _work(x_calib, "x_calib").float().reshape(-1, w.shape[1])
    x = x[:: max(1, x.shape[0] // n_tokens)]  # shape: (tokens, K)
    wg = w.reshape(w.shape[0], -1, g)  # shape: (N, groups, g)
    xg = x.reshape(x.shape[0], -1, g)  # shape: (tokens, groups, g)
    ref = torch.einsum("tgk,ngk->ntg", xg, wg)  # each group's partial outputs
    amax = wg.abs().amax(dim=-1, keepdim=True)  # shape: (N, groups, 1)
    best, best_err = amax.clone(), torch.full_like(amax, float("inf"))
    sch = _int_scheme(scheme)
    for i in range(int(max_shrink * n_grid)):
        m = amax * (1 - i / n_grid)
        q = fake_quantize(torch.clamp(wg, -m, m).reshape(w.shape), sch, g).reshape(wg.shape)
        err = (torch.einsum("tgk,ngk->ntg", xg, q) - ref).pow(2).mean(dim=1)[..., None]
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, m, best)
    return torch.clamp(wg, -best, best).reshape(w.shape)
