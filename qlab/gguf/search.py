"""The scale searches of llama.cpp's K-quants and importance-matrix quantizers.

Each function takes groups x of shape (N, n) (float32; N groups quantized independently)
and follows the C function of the same name in ggml-quants.c, vectorised over the N groups
and sequential over the n elements where C accumulates (see _ggml.py for the arithmetic).
They return (scale, L): the fp32 scale(s) and the integer codes L (int32, (N, n)).

    make_qx_quants   symmetric: L in [-nmax, nmax-1] (stored + nmax), scale fitted by
                     weighted least squares over 19 trial scales -(nmax + 0.1 i) / max,
                     i = 0 first, then i = -9..9 without 0 (C: for is = -9..9, is != 0).
                     Q6_K (weights x^2), Q3_K and the importance-matrix Q4_0 / Q5_0.
    make_q3_quants   symmetric with a few passes of per-element code refinement. Q3_K.
    make_qkx         asymmetric (scale and min), the best of nstep trial grids, each refitted
                     by weighted least squares. make_qkx2_quants (Q4_K, Q5_K) and
                     make_qkx3_quants (importance-matrix Q4_1, Q5_1, Q4_K, Q5_K).
    make_qp_quants   non-negative values (the 8 sub-block scales or mins of a K-quant
                     super-block) onto 0..nmax with a weighted search: importance matrix only.

All rounding is ggml's nearest_int (round half to even); codes are clamped as in C, and kept
in C's integer types where that matters (make_qp_quants' uint8_t codes wrap).
"""

from __future__ import annotations

import torch

from qlab.gguf._ggml import (
    GROUP_MAX_EPS,
    div,
    f32,
    first_absmax,
    first_min,
    nearest_int,
    seq_sum,
    sum_from_zero,
)


def _weighted_sums(w: torch.Tensor, x: torch.Tensor, lf: torch.Tensor):
    """C's `sumlx += w*x[i]*l; suml2 += w*l*l;` from 0 (left to right: (w*x)*l, (w*l)*l)."""
    return sum_from_zero((w * x) * lf), sum_from_zero((w * lf) * lf)


def make_qx_quants(
    x: torch.Tensor, nmax: int, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): weights default to x^2.

    Returns (scale (N,), L (N, n) in 0..2 nmax - 1). An all-zero group (max |x| < 1e-15)
    gets scale 0 and L = 0."""
    amax, signed_max = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    m = torch.where(zero, torch.ones_like(signed_max), signed_max)
    w = x * x if weights is None else weights
    xt, wxt, wt = _columns(x), _columns(w * x), _columns(w)  # shape: (n, N)

    def trial(iscale: torch.Tensor):  # _weighted_sums on the columns: (w*x)*l, (w*l)*l
        lv = torch.clamp(nearest_int(iscale * xt), -nmax, nmax - 1)
        lf = lv.to(torch.float32)
        return lv, sum_from_zero((wxt * lf).T), sum_from_zero(((wt * lf) * lf).T)

    lv, sumlx, suml2 = trial(div(-float(nmax), m))
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(suml2))
    best = scale * sumlx
    best_l = lv
    for i in range(-9, 10):
        if i == 0:
            continue
        lv, sumlx, suml2 = trial(div(-f32(nmax + f32(f32(0.1) * i)), m))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_l = torch.where(better, lv, best_l)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    best_l = torch.where(zero, torch.full_like(best_l, -nmax), best_l)
    return torch.where(zero, torch.zeros_like(scale), scale), (best_l + nmax).T.contiguous()


def _columns(x: torch.Tensor) -> torch.Tensor:
    """(N, n) groups -> (n, N), contiguous: element i of every group in one row, so that the
    searches' elementwise steps broadcast a per-group value (N,) over the rows and C's sums
    over a group (sum_from_zero(t.T)) add whole contiguous rows, with no copy per sum. The
    same float operations as on (N, n), so the same bits, in about half the time (measured,
    1 core, 36864 groups of 32: make_qkx with 37 trials 2.0 s -> 1.0 s, make_qx_quants
    0.6 s -> 0.33 s)."""
    return x.T.contiguous()


def _refine(x, w, L, sumlx, suml2, lo: int, hi: int, need_sl2: bool):
    """The per-element refinement passes shared by make_q3_quants and make_qp_quants: for
    each element in turn, try the code that is optimal with the others fixed and keep it when
    the weighted fit improves (sequential over elements, 5 passes; a pass that changes nothing
    changes nothing again, so running all 5 equals C's early break).

    need_sl2=True is make_qp_quants, whose codes live in a uint8_t array: a code stored there
    wraps (-1 is kept as 255) and the next pass reads the wrapped value back."""
    for _ in range(5):
        for i in range(x.shape[1]):
            xi, wi, li = x[:, i], w[:, i], L[:, i].to(torch.float32)
            slx = sumlx - (wi * xi) * li
            sl2 = suml2 - (wi * li) * li
            ok = (slx > 0) & (sl2 > 0) if need_sl2 else slx > 0
            safe = torch.where(ok, slx, torch.ones_like(slx))
            new_l = torch.clamp(nearest_int((xi * sl2) / safe), lo, hi)
            nf = new_l.to(torch.float32)
            slx2 = slx + (wi * xi) * nf
            sl22 = sl2 + (wi * nf) * nf
            gain = (slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22
            take = ok & (new_l != L[:, i]) & gain
            if not need_sl2:
                take &= sl22 > 0
            L[:, i] = torch.where(take, new_l & 0xFF if need_sl2 else new_l, L[:, i])
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
    return L, sumlx, suml2


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants(n, nmax, x, L, do_rmse=true), weights x^2. Returns (scale, L in
    0..2 nmax - 1); an all-zero group gets scale 0 and L = 0."""
    amax, signed_max = first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    m = torch.where(zero, torch.ones_like(signed_max), signed_max)
    w = x * x
    L = torch.clamp(nearest_int(div(-float(nmax), m)[:, None] * x), -nmax, nmax - 1)
    sumlx, suml2 = _weighted_sums(w, x, L.to(torch.float32))
    L, sumlx, suml2 = _refine(x, w, L, sumlx, suml2, -nmax, nmax - 1, need_sl2=False)
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(suml2))
    L = torch.where(zero[:, None], torch.zeros_like(L), L + nmax)
    return torch.where(zero, torch.zeros_like(scale), scale), L


def make_qkx(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants / make_qkx3_quants (use_mad = false) with explicit weights.

    Fits x ~ scale * L + min with L in 0..nmax and min <= 0: first the min/max grid, then
    nstep + 1 trial grids iscale = (rmin + rdelta * i + nmax) / (max - min), each refitted by
    weighted least squares (the min is clamped to <= 0), keeping the lowest weighted squared
    error. As in C, min is updated whenever a better fit is found, and the later trials use
    it (in the grid and in max - min). Returns (scale (N,), the_min = -min >= 0 (N,), L).
    The two C functions run the same search; they differ only in their defaults (qkx3 weighs
    by x^2 when given no weights, which no caller here does) and in their exit test for a
    flat group (max == min vs max <= min: the same, as max >= min). The scale can come out
    negative (a weighted least-squares fit where few weights are nonzero)."""
    lo = first_min(x)
    lo = torch.where(lo > 0, torch.zeros_like(lo), lo)  # C: `if (min > 0) min = 0;` keeps -0.0
    hi = x.amax(dim=1)
    flat = hi == lo  # C: L = 0, the_min = -min, scale 0
    xt, wt = _columns(x), _columns(w)  # shape: (n, N); a (N,) value broadcasts over rows
    sum_w, sum_x = seq_sum(wt.T), seq_sum((wt * xt).T)  # C: from w[0] and w[0] * x[0]
    span = torch.where(flat, torch.ones_like(hi), hi - lo)  # flat groups: any nonzero span
    iscale = div(float(nmax), span)
    scale = div(1.0, iscale)
    L = torch.clamp(nearest_int(iscale * (xt - lo)), 0, nmax)
    diff = (scale * L.to(torch.float32) + lo) - xt
    best = sum_from_zero((wt * (diff * diff)).T)
    mn = lo
    for step in range(nstep + 1):
        grid = f32(f32(f32(rmin) + f32(f32(rdelta) * step)) + nmax)
        trial_iscale = div(grid, torch.where(flat, torch.ones_like(hi), hi - mn))
        v = trial_iscale * (xt - mn)
        lv = torch.clamp(nearest_int(v), 0, nmax)
        lf = lv.to(torch.float32)
        wl = wt * lf
        sum_l = sum_from_zero(wl.T)
        sum_l2 = sum_from_zero((wl * lf).T)
        sum_xl = sum_from_zero((wl * xt).T)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        safe_D = torch.where(ok, D, torch.ones_like(D))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_D
        pos = this_min > 0
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        d2 = (this_scale * lf + this_min) - xt
        err = sum_from_zero((wt * (d2 * d2)).T)
        better = ok & (err < best) & ~flat
        L = torch.where(better, lv, L)
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    L = torch.where(flat, torch.zeros_like(L), L).T.contiguous()
    return torch.where(flat, torch.zeros_like(scale), scale), -mn, L


def make_qp_quants(
    x: torch.Tensor, nmax: int, quant_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants(n, nmax, x, L, quant_weights): x (sub-block scales or mins, meant to
    be >= 0) onto L in 0..nmax times one scale, weighted. Returns (scale (N,), L (N, n)).

    L is C's uint8_t array. A negative x (make_qkx3_quants can return a negative sub-block
    scale) rounds to a negative code, which C stores wrapped (-1 -> 255); the first error
    estimate and every refinement pass read that 255 back, while the trial loop and the
    final sums use the unwrapped int. qlab does the same, so L can hold 255 (and the caller
    decides what to store: Q4_K packs all 8 bits, Q5_K clamps to 63 first)."""
    mx = torch.clamp(x.amax(dim=1), min=0.0)
    zero = mx < GROUP_MAX_EPS
    m = torch.where(zero, torch.ones_like(mx), mx)
    w = quant_weights

    def mse(iscale, first: bool):
        lv = nearest_int(iscale[:, None] * x)
        # first: C's `L[i] = nearest_int(...)` into uint8_t, read back; trials: min(nmax, int)
        lv = lv & 0xFF if first else torch.clamp(lv, max=nmax)
        d = x - div(1.0, iscale)[:, None] * lv.to(torch.float32)
        return sum_from_zero((w * d) * d)

    iscale = div(float(nmax), m)
    best = mse(iscale, first=True)
    for i in range(-4, 5):
        if i == 0:
            continue
        trial = div(f32(f32(f32(0.1) * i) + nmax), m)
        err = mse(trial, first=False)
        better = err < best
        best = torch.where(better, err, best)
        iscale = torch.where(better, trial, iscale)
    L = torch.clamp(nearest_int(iscale[:, None] * x), max=nmax)
    sumlx, suml2 = _weighted_sums(w, x, L.to(torch.float32))  # the int codes
    L = L & 0xFF  # stored into uint8_t: what the refinement reads back
    L, sumlx, suml2 = _refine(x, w, L, sumlx, suml2, -(2**31), nmax, need_sl2=True)
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(suml2))
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(
        zero[:, None], torch.zeros_like(L), L
    )
