"""Input generators shared by task modules: every draw goes through the seeded Generator.

Also the pieces the Triton tasks (chapters 08-10) share: the interpreter environment and
the int4 weights packed the way the kernels read them.
"""

from __future__ import annotations

import torch

import qlab

# Triton tasks run on the CPU interpreter when graded (set in the grading kernel); this
# also marks them as kernel tasks, whose loads and stores are bounds-checked (_bounds.py)
INTERPRETER = {"TRITON_INTERPRET": "1"}


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


def int4_qtensor(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> qlab.QTensor:
    """The int4 QTensor whose codes qlab.pack_int4 packed into ``packed`` (uint8 (N, K/2)),
    with fp16 ``scales`` (N, K / group_size)."""
    return qlab.QTensor(
        codes=qlab.unpack_int4(packed, signed=True),
        scales=scales,
        zero_points=None,
        scheme=qlab.get_scheme("int4"),
        granularity=group_size,
    )


def packed_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qlab's int4 (group absmax, fp16 scales) of w (N, K): (packed uint8 (N, K/2), scales)."""
    qt = qlab.quantize(w, "int4", group_size)
    return qlab.pack_int4(qt.codes), qt.scales


def fp16_scale_straddle(g: torch.Generator, divisor: int, k: int) -> tuple[float, float]:
    """(amax, x) where the stored scale s = fp16(amax / divisor) and the unrounded float32
    scale round x to different integers (x / s is near k + 0.5): a case in which dividing by
    the float32 scale instead of the stored float16 one changes a code."""
    for _ in range(200):
        amax = float(torch.empty(()).uniform_(0.5, 4.0, generator=g))
        s32 = torch.tensor(amax) / divisor
        s16 = s32.to(torch.float16).float()
        x = (k + 0.5) * (s16 + s32) / 2
        if torch.round(x / s16) != torch.round(x / s32):
            return amax, float(x)
    raise RuntimeError(f"no float16 straddle found for divisor {divisor}, k {k}")


def fp16_amax_trap(g: torch.Generator, divisor: int) -> float:
    """A float32 absmax whose stored scale fp16(amax / divisor) differs from the one computed
    from the absmax rounded to float16 first, fp16(fp16(amax) / divisor): a case in which
    rounding the absmax (instead of the scale) to float16 changes the scale."""
    for _ in range(200):
        amax = torch.empty(()).uniform_(0.5, 4.0, generator=g)
        if (amax / divisor).half() != (amax.half().float() / divisor).half():
            return float(amax)
    raise RuntimeError(f"no float16 absmax trap found for divisor {divisor}")


def fp16_subnormal_scale(g: torch.Generator, qmax: int) -> float:
    """A float32 quotient amax / qmax = (k + u) 2^-24 (k <= qmax / 4, u in [0.3, 0.45]) that
    float16 stores as the subnormal k 2^-24, rounded down by over a tenth: then
    amax / s = qmax (k + u) / k >= qmax + 0.5 rounds past the grid, and the clamp acts."""
    k = randint(g, 1, max(1, qmax // 4))
    return (k + float(torch.empty(()).uniform_(0.3, 0.45, generator=g))) * 2.0**-24


def reciprocal_trap(g: torch.Generator, k: int) -> float:
    """A float16 scale s in [1, 2) for which x = (k + 0.5) * s divides to exactly k + 0.5 (a
    tie, round-half-to-even) while x * float32(1 / s) rounds to the other neighbour: a case
    in which multiplying by the reciprocal instead of dividing changes a code."""
    s = (1 + torch.arange(1024) / 1024).to(torch.float16).float()  # every fp16 in [1, 2)
    x = (k + 0.5) * s  # exact: <= 8 + 11 significant bits
    ok = (torch.round(x * (1 / s)) != torch.round(x / s)).nonzero().flatten()
    if ok.numel() == 0:
        raise ValueError(f"no reciprocal trap for k = {k}; pick another k")
    return float(s[ok[randint(g, 0, ok.numel() - 1)]])


def rounding_splits(spec, wrong, centres: torch.Tensor, g: torch.Generator, ulps: int = 16):
    """Float32 values within ``ulps`` ulps of ``centres`` or of the midpoints between them
    (where rounding decisions are close) on which the ``spec`` computation and a ``wrong``
    one (another order of operations) give different codes, in a seeded random order. May
    be empty: the caller draws other centres."""
    centres = centres.float()
    cand = [torch.cat([centres, (centres[:-1] + centres[1:]) / 2])]
    for direction in (float("inf"), float("-inf")):
        c = cand[0]
        for _ in range(ulps):
            c = torch.nextafter(c, torch.tensor(direction))
            cand.append(c)
    cand = torch.cat(cand)
    hits = cand[spec(cand) != wrong(cand)]
    return hits[torch.randperm(hits.numel(), generator=g)]
