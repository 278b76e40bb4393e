"""LLM.int8() (Dettmers et al. 2022): a mixed-precision decomposition of x @ W^T.

Outlier features sit in a few input channels (columns of x). LLM.int8() splits the matmul by
column:

    O = { j : |x[t, j]| >= threshold for some token t }              (bitsandbytes' test: >=)
    x W^T = x[:, O] @ W[:, O]^T          in 16 bit (float16 operands, float32 accumulate)
          + x[:, R] @ W[:, R]^T          in int8, R = the other columns: per-token scales for
                                         x, per-output-channel scales for W (vector-wise),
                                         exact integer sums, rescaled once

The int8 part is qlab.pipelines.w8a8_reference on x and W with the outlier columns set to 0,
so its scales come from the remaining columns only. threshold = 6.0 is the paper's; with it,
the paper reports more than 99.9 % of the values of large LLMs multiplied in 8 bit.

bitsandbytes keeps the weight only in int8: its weight scales cover whole rows and the
16-bit part uses the dequantized int8 weight columns. qlab follows the paper's description
(16-bit weights for the outlier columns).
"""

from __future__ import annotations

import torch

from qlab._tensor import as_float32
from qlab.pipelines import w8a8_reference

__all__ = ["mixed_precision_matmul", "outlier_columns"]

FP16_MAX = torch.finfo(torch.float16).max  # 65504.0


def outlier_columns(x, threshold: float = 6.0) -> torch.Tensor:
    """bool (K,): True for each input channel j with |x[..., j]| >= threshold in some token."""
    x = as_float32(x)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    if x.ndim == 0:
        raise ValueError("x must have a last axis of input channels")
    return (x.reshape(-1, x.shape[-1]).abs() >= threshold).any(dim=0)


def mixed_precision_matmul(x, w, threshold: float = 6.0, scheme: str = "int8") -> torch.Tensor:
    """LLM.int8()'s x @ w^T: outlier columns in float16, the rest in ``scheme`` (int8: per
    token and per output channel), summed in float32.

    x: (..., K) activations; w: (N, K) weight; returns float32 (..., N).
    threshold: a column is an outlier when any |x| in it is >= threshold (0 sends every
    column to 16 bit, inf none). scheme: any scheme of qlab.pipelines.w8a8_reference."""
    x, w = as_float32(x), as_float32(w, "w")
    if w.ndim != 2 or x.ndim == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"x (..., K) and w (N, K) must share K: got x {tuple(x.shape)}, w {tuple(w.shape)}"
        )
    cols = outlier_columns(x, threshold)
    idx = cols.nonzero().reshape(-1)  # the outlier channels, int64 (n_outliers,)
    x2 = x.reshape(-1, x.shape[-1])  # shape: (tokens, K)
    x_o, w_o = x2.index_select(1, idx), w.index_select(1, idx)
    if x_o.numel() and float(x_o.abs().max()) > FP16_MAX:
        raise ValueError(f"an outlier of {float(x_o.abs().max()):.4g} does not fit float16 "
                         f"(max {FP16_MAX}); scale the input down")
    y16 = x_o.half().float() @ w_o.half().float().T  # fp16 operands, fp32 accumulate
    y8 = w8a8_reference(x2.masked_fill(cols, 0.0), w.masked_fill(cols, 0.0), scheme,
                        "channel", "token")
    return (y16 + y8).reshape(*x.shape[:-1], w.shape[0])
