"""Input generators shared by task modules: every draw goes through the seeded Generator."""

from __future__ import annotations

import torch


def randint(g: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi]."""
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def choice(g: torch.Generator, options):
    return options[randint(g, 0, len(options) - 1)]


def weights(g: torch.Generator, shape, scale: float | None = None, outliers: bool = False):
    """float32 normal weights with a random scale (and optionally a few large outliers)."""
    if scale is None:
        scale = float(torch.empty(()).uniform_(0.01, 3.0, generator=g))
    w = torch.randn(shape, generator=g) * scale
    if outliers and w.numel() >= 8:
        flat = w.reshape(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 64),), generator=g)
        flat[idx] *= 8.0
    return w


def on_grid(g: torch.Generator, shape, step: float, lo: int, hi: int) -> torch.Tensor:
    """Values k * step / 2 with k in [2*lo, 2*hi]: plenty of exact .5 ties for RNE tests."""
    k = torch.randint(2 * lo, 2 * hi + 1, shape, generator=g)
    return k.to(torch.float32) * (step / 2)


def shape_2d(g: torch.Generator, max_rows: int = 6, k_choices=(8, 16, 32, 64)):
    return (randint(g, 1, max_rows), choice(g, k_choices))
