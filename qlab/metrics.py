"""Error and quality metrics. Computed in float64; scalars come back as Python floats."""

from __future__ import annotations

import math

import torch

__all__ = ["rmse", "sqnr_db", "kl_divergence", "flip_rate"]


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x).detach().to(torch.float64)


def rmse(a, b) -> float:
    """sqrt(mean((a - b)^2))."""
    a, b = _f64(a), _f64(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return math.sqrt(float(((a - b) ** 2).mean()))


def sqnr_db(x, x_hat) -> float:
    """Signal-to-quantization-noise ratio, 10 log10(sum x^2 / sum (x - x_hat)^2); inf if exact."""
    x, x_hat = _f64(x), _f64(x_hat)
    noise = float(((x - x_hat) ** 2).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(float((x**2).sum()) / noise)


def kl_divergence(p_logits, q_logits, reduction: str = "mean"):
    """KL(P || Q) in nats between the softmaxes of two logit tensors (..., vocab).

    reduction "mean" -> float over all positions; "none" -> per-position tensor.
    """
    logp = torch.log_softmax(_f64(p_logits), dim=-1)
    logq = torch.log_softmax(_f64(q_logits), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(dim=-1)
    return float(kl.mean()) if reduction == "mean" else kl


def flip_rate(a_logits, b_logits) -> float:
    """Fraction of positions whose top-1 (argmax) prediction differs."""
    a, b = torch.as_tensor(a_logits), torch.as_tensor(b_logits)
    return float((a.argmax(dim=-1) != b.argmax(dim=-1)).double().mean())
