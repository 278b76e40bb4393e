"""Chapter 12 (outliers): SmoothQuant scales, the fast Walsh-Hadamard transform, LLM.int8().

Spec clauses, and the fixed case (present on every seed) where breaking each one changes
the answer (tests/grading/mutants_ch12.py holds a mutant per clause):

smooth_scales(act_absmax, weight_absmax, alpha) -> float32 (K,)
  S1 s = a^alpha / w^(1 - alpha): activations over weights ..... every case (alpha 0, 1 too)
  S2 s = 1 on a channel where a = 0 OR w = 0 (not clamped) ..... a dead channel in every case
  S3 returned as float32 (the dtype is graded) ................. every case
fwht(x (..., n)) -> float32 (..., n)
  F1 orthonormal: divided by sqrt(n) once, 12-point part included .. every case
  F2 the butterfly is (a + b, a - b) ................................. every case
  F3 n = 12 * 2^k: the 12-point matrix (as qlab.ptq.hadamard builds it)
     kron H_2^k, the 12-point one outside, every block mixed ......... the 12 * 2^k cases
  F4 never form the n x n matrix: no tensor or array may hold more than
     max(4 x the input's elements, 144) (SizeLimit) ................. every case (n >= 256
     in the last one, so a matrix of n x n breaks it on every seed)
  F5 a float32 result (the dtype is graded) ......................... every case
llm_int8_matmul(x (M, K), w (N, K), threshold) -> float32 (M, N)
  I1 outlier COLUMNS: any |x| >= threshold (ends included) in them .. a value == threshold
  I2 the threshold is the argument, not 6 ........................... a case at 3 or 4.5
  I3 outlier columns in fp16 (x and w rounded to float16) ........... every case
  I4 the rest int8 with fp16 scales per token and per output channel,
     from the rows with the outlier columns removed ................. every case
  I5 an all-zero int8 row (scale 0) gives 0, not NaN ................ the third case
  I6 w's outlier columns zeroed too before its scales (w is largest
     there in every row of the "traps" case) .......................... "traps"
  I7 v / s with the STORED fp16 scale, not the float32 one ........... "traps" row 1
  I8 round half to even, a true division v / s (not v * (1 / s)) .... "traps" row 0 ties
  I9 the float32 absmax divided, then rounded to fp16 ................ "traps" row 2
  I10 a float32 result (the dtype is graded) ........................ every case
  I11 codes clamped to +-127: a subnormal fp16 scale (below 2^-14),
      rounded down, puts amax / s past 127.5 ........................ the 4th case, x row 0
  (with a normal fp16 s the clamp never acts, as in chapter 01: |v / s| <= 127 (1 + 2^-11))
  (I7-I9 pin qlab's order on purpose, not bitsandbytes': the spec's first sentence says so, and
  the feedback names v * (1 / s), the float32 scale or fp16(amax) where they differ)
"""

from __future__ import annotations

import torch

from qlab.grading.registry import Mismatch, SizeLimit, close, tasks_for
from qlab.grading.tasks._inputs import (
    choice,
    fp16_amax_trap,
    fp16_scale_straddle,
    fp16_subnormal_scale,
    randint,
    reciprocal_trap,
    weights,
)
from qlab.grading.tasks._spec import int8_row_note
from qlab.ptq import fwht, mixed_precision_matmul, smooth_scales

task = tasks_for("12_outliers")


# --------------------------------------------------------------------------- SmoothQuant


def _absmax_pair(g: torch.Generator, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation maxima with a few outlier channels, weight maxima, and in EVERY draw a dead
    activation channel, a dead weight column and a channel dead on both sides."""
    act = weights(g, (k,), scale=1.0).abs() + 0.05
    act[torch.randperm(k, generator=g)[:2]] *= 40.0  # outlier channels
    wgt = weights(g, (k,), scale=0.05).abs() + 1e-3
    dead = torch.randperm(k, generator=g)[:3]
    act[dead[0]] = 0.0  # 0^alpha: 0 (or 1 at alpha = 0): s must be 1
    wgt[dead[1]] = 0.0  # division by 0^(1 - alpha): inf (or 1 at alpha = 1): s must be 1
    act[dead[2]], wgt[dead[2]] = 0.0, 0.0  # 0 / 0
    return act, wgt


def _smooth_cases(g: torch.Generator):
    cases = []
    for alpha in (choice(g, (0.3, 0.5, 0.65, 0.8)), 0.0, 1.0, 0.5):  # both extremes every run
        act, wgt = _absmax_pair(g, randint(g, 6, 64))
        cases.append((act, wgt, alpha))
    return cases


task("smooth_scales", "smooth_scales", points=2,
     implements=("qlab.ptq.smooth_scales",),
     reference=lambda act_absmax, weight_absmax, alpha: smooth_scales(act_absmax,
                                                                      weight_absmax, alpha),
     compare=close(rtol=1e-6),
     signature="smooth_scales(act_absmax (K,), weight_absmax (K,), alpha) -> float32 (K,)"
     )(_smooth_cases)


# --------------------------------------------------------------------------- FWHT


def _fwht_cases(g: torch.Generator):
    cases = []
    k = randint(g, 1, 7)  # a power of two, 2..128
    cases.append((weights(g, (randint(g, 1, 4), 2**k), scale=1.0),))
    k = randint(g, 1, 5)  # 12 * 2^k with k >= 1: the Kronecker order and H12's orientation show
    cases.append((weights(g, (randint(g, 1, 4), 12 * 2**k), scale=1.0),))
    cases.append((weights(g, (randint(g, 1, 3), 12), scale=1.0),))  # 12 itself (2^0)
    x = weights(g, (2, randint(g, 1, 3), choice(g, (384, 256, 1536))), scale=1.0)  # leading dims
    x[..., randint(g, 0, x.shape[-1] - 1)] *= 20.0  # an outlier channel
    cases.append((x,))
    return cases


# the spec's O(n log n) rule: the butterflies need copies of x's size, the 12-point part
# the 12 x 12 H12; a matrix of n x n is larger than this in the cases with n > 4 x the rows
FWHT_SIZE = SizeLimit(
    lambda x: max(4 * x.numel(), 144),
    "the spec forbids forming the n x n matrix (O(n log n) butterflies; the 12 x 12 H12 is "
    "fine): no tensor or array may hold more than max(4 x the input's elements, 144)",
)

task("fwht", "fwht", points=3, reference=lambda x: fwht(x), compare=close(rtol=1e-5, atol=2e-5),
     implements=("qlab.ptq.fwht", "qlab.ptq.hadamard"), size_limit=FWHT_SIZE,
     signature="fwht(x (..., n)) -> float32 (..., n), n = 2^k or 12 * 2^k")(_fwht_cases)


# --------------------------------------------------------------------------- LLM.int8()


def _int8_case(g: torch.Generator, threshold: float):
    m, n, k = randint(g, 3, 8), randint(g, 2, 8), choice(g, (16, 32, 64))
    x = weights(g, (m, k), scale=1.0).clamp(-0.9 * threshold, 0.9 * threshold)
    cols = torch.randperm(k, generator=g)[:3]
    x[:, cols[0]] = weights(g, (m,), scale=1.0) * 3 * threshold  # an outlier column ...
    x[0, cols[0]] = 2.71 * threshold  # ... for sure
    x[randint(g, 0, m - 1), cols[1]] = -(threshold + 0.73)  # ONE outlier value: its whole column
    x[randint(g, 0, m - 1), cols[2]] = threshold  # exactly the threshold: an outlier (>=)
    w = weights(g, (n, k), scale=choice(g, (0.05, 0.5)))
    return x, w, threshold


def _int8_cases(g: torch.Generator):
    cases = [_int8_case(g, 6.0), _int8_case(g, choice(g, (3.0, 4.5)))]  # not always 6
    x, w, t = _int8_case(g, 6.0)
    col = int((x.abs() >= t).any(0).nonzero()[0, 0])
    x[1] = 0.0
    x[1, col] = 7.3  # a token that is all outlier: its int8 row is all zero (scale 0)
    w[0] = 0.0
    w[0, col] = 0.3  # an output row whose weights are all in outlier columns: scale 0 too
    cases.append((x, w, t))
    x = weights(g, (randint(g, 2, 6), 32), scale=1.0)  # no outliers at all: pure int8
    w = weights(g, (randint(g, 2, 6), 32), scale=0.5)
    amax = 127 * fp16_subnormal_scale(g, 127)  # x row 0: a subnormal s_x, its clamp acts
    c = randint(g, 0, 31)
    x[0] = (x[0] / x[0].abs().max() * amax).clamp(-amax, amax)
    x[0, c], w[0, c] = amax, 100.0  # q_w[0, c] = 127: unclamped, y[0, 0] moves >= 1.8e-4
    cases.append((x, w, 100.0))
    cases.append(_int8_traps(g))
    return cases


def _int8_traps(g: torch.Generator):
    """Rows 0-2 of x (no outliers) read one code each through one-hot rows of w, so a single
    wrong int8 code shows: row 0 exact ties (k + 1/2) s on a reciprocal-trap fp16 scale s
    (amax = 127 s exactly), row 1 an fp16 straddle at column 9, row 2 an absmax whose fp16
    rounding before / 127 moves s_x. Row 3 puts column 15 in the outliers; every row of w
    is largest there (37x), so a w scale taken before zeroing that column is 37x coarser."""
    t, k = 6.0, randint(g, 1, 31)
    step = reciprocal_trap(g, k) * 2.0 ** randint(g, -8, -6)  # 127 step < 4 < threshold
    x = torch.empty(4, 16).uniform_(-126, 126, generator=g).round() * step
    x[0, :8] = torch.tensor([0.5, 2.5, -1.5, -0.5, 1.5, -2.5, k + 0.5, 127.0]) * step
    amax, xk = fp16_scale_straddle(g, 127, 126)
    x[1] = (x[1] / (127 * step)) * amax
    x[1, 9], x[1, 14] = xk, -amax
    amax = fp16_amax_trap(g, 127)
    x[2] = (x[2] / (127 * step) * amax).clamp(-amax, amax)
    x[2, 13] = amax
    x[:3, 15] = 0.0
    x[3] = weights(g, (16,), scale=0.5).clamp(-3.0, 3.0)
    x[3, 15] = t + 1.3  # the only outlier: column 15
    cols = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 13])
    mag = torch.logspace(-1, 1, len(cols)) * torch.where(
        torch.rand(len(cols), generator=g) < 0.5, -1.0, 1.0
    )
    w = torch.zeros(len(cols) + 1, 16)
    w[torch.arange(len(cols)), cols] = mag
    w[-1, :15] = weights(g, (15,), scale=0.1)
    w[:, 15] = 37.3 * torch.cat([mag.abs(), torch.ones(1)])  # each row's absmax
    return (x, w[torch.randperm(len(cols) + 1, generator=g)], t)


def _int8_explain(args, m: Mismatch) -> str:
    x, w, threshold = args
    r, n = m.index
    cols = (x.abs() >= threshold).any(dim=0)
    return (
        f"outlier columns {cols.nonzero().flatten().tolist()} (some |x| >= {threshold}) are "
        "multiplied in fp16 and zeroed in x AND w for the int8 part; "
        + int8_row_note(f"x row {r}", x[r].masked_fill(cols, 0.0))
        + "; "
        + int8_row_note(f"w row {n}", w[n].masked_fill(cols, 0.0))
    )


task("llm_int8_matmul", "llm_int8_matmul", points=3,
     implements=("qlab.ptq.mixed_precision_matmul",),
     reference=lambda x, w, threshold: mixed_precision_matmul(x, w, threshold, "int8"),
     compare=close(rtol=2e-5, atol=2e-5, explain=_int8_explain),
     signature="llm_int8_matmul(x (M, K), w (N, K), threshold) -> float32 (M, N)")(_int8_cases)
