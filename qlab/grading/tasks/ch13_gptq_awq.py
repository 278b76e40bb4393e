"""Chapter 13 (GPTQ and AWQ): GPTQ's inverse-Hessian factor, one GPTQ block, one AWQ scale.

Spec clauses, and the fixed case (present on every seed) where breaking each one changes
the answer (tests/grading/mutants_ch13.py holds a mutant per clause):

gptq_hinv(h, damp) -> U
  H1 dead inputs (H_ii = 0) get H_ii = 1 ..................................... every case
  H2 ... before dampening: damp * mean(diag H) includes those 1s ............ every case
  H3 dampening relative to mean(diag H), not an absolute damp ............... every case
  H4 U is the UPPER Cholesky factor of H^-1 (U^T U = H^-1), not of H ........ every case
  H5 h is not modified in place (the harness compares it after the call) .... every case
  H6 U float64 (the dtype is graded) ........................................ every case
gptq_block(w, u, bits, group_size) -> (codes, scales, err)
  B1 round half to even ..................................... "edges": column 0, exact ties
  B2 fp16 scales ........................................................... every case
  B3 a group's scale from its columns AFTER the earlier columns' updates .. "edges": group 1
  B4 err = (w - q) / U_ii .................................................. every case
  B5 the columns after i move by err_i * U[i, i:] (row i of U) ............. every case
  B6 the scale from the float32 absmax, divided in float32 (float64 rounds
     once where float32 rounds twice) ....................... "edges": group 3 absmax
  B7 codes from a float32 division fp32(w) / s (not float64) . "edges": group 3, column 0
  B8 w is not modified in place (the harness compares it after the call) .... every case
  B9 codes clamped to +-qmax (an update pushes a value past qmax * s) ..... "edges": group 4
  B10 codes int8, scales float16, err float64 (the dtypes are graded) ....... every case
  (B6, B7 pin qlab.ptq.gptq_block's float32 steps on purpose: the spec's first sentence says so,
  and the feedback names the float64 scale or w / s where they differ)
  (and an all-zero group of dead inputs, "edges" group 2: scale 0, codes 0, err 0)
awq_scale(x, w, alpha, bits, group_size) -> (s, err)
  A1 s from the MEAN of |x| per channel ..................................... every case
  A2 clamped to >= 1e-4 BEFORE normalising (a dead channel has mean 0) ..... "dead" case
  A3 normalised by sqrt(max(s) * min(s)) .................................... every case
  A4 W_hat = Q(W * s) / s ................................................... every case
  A5 err = mean over samples and outputs of (x W^T - x W_hat^T)^2 ........... every case
  A6 s float32 (the dtype is graded) ........................................ every case
"""

from __future__ import annotations

import math

import torch

from qlab.grading.registry import Mismatch, compare_values, tasks_for
from qlab.grading.tasks._inputs import choice, randint
from qlab.grading.tasks._spec import div32, int_rounding, num
from qlab.ptq import hessian
from qlab.ptq.awq import act_mean_abs, awq_scales, awq_weight
from qlab.ptq.gptq import gptq_block, layer_error, prepare_hessian, upper_cholesky_of_inverse

task = tasks_for("13_gptq_awq")


# --------------------------------------------------------------------------- gptq_hinv


def _hessian_case(g: torch.Generator, k: int, n_dead: int, damp: float):
    """2 X^T X / n of n = 3k correlated samples with channels of very different sizes
    (mean diag far from 1, so H1-H3 each move U), n_dead channels always 0."""
    mix = torch.randn(k, k, generator=g, dtype=torch.float64) * 0.4 + torch.eye(k)
    x = torch.randn(3 * k, k, generator=g, dtype=torch.float64) @ mix
    x = x * (0.5 + 3 * torch.rand(k, generator=g, dtype=torch.float64))
    x[:, torch.randperm(k, generator=g)[:n_dead]] = 0.0
    return (hessian(x), damp)


def _hinv_cases(g: torch.Generator):
    return [_hessian_case(g, randint(g, 6, 24), randint(g, 1, 3), choice(g, (0.01, 0.05, 0.1)))
            for _ in range(4)]


def _hinv_reference(h, damp):
    h = h.clone()
    prepare_hessian(h, torch.zeros(1, h.shape[0], dtype=h.dtype), damp)
    return upper_cholesky_of_inverse(h)


def _hinv_compare(expected, got, args):
    """float64 factorisations by another route (cholesky -> cholesky_inverse -> cholesky,
    or an explicit inverse) agree to ~cond(H) * 1e-16 ~ 1e-13 of max|U| on these
    well-conditioned H; every wrong clause moves U by more than 1e-4 of it."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return compare_values(expected, got, args, path="U")
    return compare_values(expected, got, args, atol=1e-9 * float(expected.abs().max()),
                          path="U")


task("gptq_hinv", "gptq_hinv", points=2, reference=_hinv_reference, compare=_hinv_compare,
     implements=("qlab.ptq.gptq.upper_cholesky_of_inverse", "qlab.ptq.gptq.prepare_hessian"),
     signature="gptq_hinv(h float64 (K, K), damp) -> U float64 (K, K), upper triangular"
     )(_hinv_cases)


# --------------------------------------------------------------------------- gptq_block


def _upper(g: torch.Generator, b: int, dead: list[int]) -> torch.Tensor:
    """A block of U: upper triangular, positive diagonal, off-diagonals ~0.3 of it; rows and
    columns of dead inputs zero off the diagonal (as their H^-1 is)."""
    d = 0.5 + torch.rand(b, generator=g, dtype=torch.float64)
    u = torch.triu(torch.randn(b, b, generator=g, dtype=torch.float64) * 0.3, 1) * d[:, None]
    u[dead, :] = 0.0
    u[:, dead] = 0.0
    return u + torch.diag(d)


def _random_block(g: torch.Generator):
    gs = choice(g, (4, 8, 16))
    n, b = randint(g, 3, 8), gs * randint(g, 1, 3)
    w = torch.randn(n, b, generator=g, dtype=torch.float64) * choice(g, (0.05, 1.0, 3.0))
    return (w, _upper(g, b, []), randint(g, 2, 8), gs)


def _amax_trap(g: torch.Generator, qmax: int) -> tuple[float, float]:
    """(a, h): a float64 absmax a whose float32 path fp16(fp32(fp32(a) / qmax)) gives the
    float16 value h while float64 division, fp16(fp32(a / qmax)), gives the next float16
    (torch converts float64 to float16 through float32). a = m qmax (1 + d), m the midpoint
    above h (h with an even last bit): fp32(a) = m qmax exactly, / qmax = m, a tie that goes
    to h; a / qmax = m (1 + d) is more than half a float32 ulp above m, so it goes up."""
    for _ in range(200):
        mantissa, exponent = 1024 + 2 * randint(g, 0, 511), -(10 + randint(g, 2, 7))
        h, mid = mantissa * 2.0**exponent, (mantissa + 0.5) * 2.0**exponent
        m_mid = mid / 2.0 ** math.floor(math.log2(mid))  # significands in [1, 2)
        prod = mid * qmax  # <= 12 + 7 significant bits: exact in float32
        m_prod = prod / 2.0 ** math.floor(math.log2(prod))
        a = torch.tensor(prod * (1 + 2.0**-24 * (1 / m_mid + 1 / m_prod) / 2), dtype=torch.float64)
        right = (a.float() / qmax).half()
        if right == h and (a / qmax).float().half() != right:
            return float(a), h
    raise RuntimeError(f"no float64 absmax trap for qmax {qmax}")


def _float64_traps(g: torch.Generator, n: int, gs: int, qmax: int) -> torch.Tensor:
    """A group (n, gs) whose row r has an _amax_trap absmax (B6: float64 arithmetic gives
    the next float16 scale) and in column 0 +-(k + 1/2) h_r (1 + 2^-35), k even: float32
    rounds it to the exact tie, which goes to k; float64 sees it above the tie: k + 1 (B7)."""
    grp = torch.rand(n, gs, generator=g, dtype=torch.float64) * 2 - 1
    for r in range(n):
        a, h = _amax_trap(g, qmax)
        k = 2 * randint(g, 0, (qmax - 1) // 2)
        sign = choice(g, (1.0, -1.0))
        grp[r] *= (qmax - 1) * h
        grp[r, 0] = sign * (k + 0.5) * h * (1 + 2.0**-35)
        grp[r, randint(g, 1, gs - 1)] = -sign * a
    return grp


def _edge_block(g: torch.Generator):
    """Five groups. Group 0: every row's largest |w| is exactly qmax * 2^-e (so the fp16
    scale is 2^-e, exact) and column 0 holds exact ties (k + 1/2) * 2^-e with k even, where
    half-to-even and half-away differ (B1). Group 1 is quantized after the updates of group
    0's columns have moved it (B3). Group 2 is dead: zero weights, no updates. Group 3:
    _float64_traps (B6, B7), which no earlier column updates (its U entries are 0). Group 4
    (also left alone by earlier columns): an update that the clamp must cut back (B9)."""
    bits, gs = randint(g, 3, 5), choice(g, (4, 8))
    qmax, n = 2 ** (bits - 1) - 1, randint(g, 4, 8)
    step = 2.0 ** -torch.randint(2, 8, (n, 1), generator=g).double()
    grp0 = (torch.rand(n, gs, generator=g, dtype=torch.float64) * 2 - 1) * (qmax - 1) * step
    k_even = 2 * torch.randint(0, (qmax - 1) // 2 + 1, (n,), generator=g)  # |tie| <= qmax - 1/2
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    grp0[:, 0] = sign * (k_even + 0.5).double() * step[:, 0]
    grp0[torch.arange(n), torch.randint(1, gs, (n,), generator=g)] = qmax * step[:, 0]
    grp1 = torch.randn(n, gs, generator=g, dtype=torch.float64) * step * qmax / 2
    grp3 = _float64_traps(g, n, gs, qmax)
    # group 4: column 0 rounds off by 0.4 step; U[i, i + 1] = 3 U[i, i] then pushes column
    # 1, the group's absmax qmax * step, to (qmax + 1.2) * step: the clamp must act (B9)
    grp4 = (torch.rand(n, gs, generator=g, dtype=torch.float64) * 2 - 1) * (qmax - 1) * step
    sign = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).double()
    k = torch.randint(0, qmax, (n,), generator=g).double()
    grp4[:, 0] = sign * (k + 0.4) * step[:, 0]
    grp4[:, 1] = -sign * qmax * step[:, 0]
    w = torch.cat([grp0, grp1, torch.zeros(n, gs, dtype=torch.float64), grp3, grp4], dim=1)
    u = _upper(g, 5 * gs, list(range(2 * gs, 3 * gs)))
    u[: 3 * gs, 3 * gs :] = 0.0  # groups 3 and 4 are quantized as they were given
    u[3 * gs : 4 * gs, 4 * gs :] = 0.0
    u[4 * gs, 4 * gs + 1] = 3 * u[4 * gs, 4 * gs]
    return (w, u, bits, gs)


def _block_cases(g: torch.Generator):
    return [_random_block(g), _random_block(g), _edge_block(g)]


def _block_reference(w, u, bits, group_size):
    qt, err = gptq_block(w, u, f"int{bits}", group_size)
    return qt.codes, qt.scales, err


def _block_explain(args, m: Mismatch) -> str:
    """Step 1 or 2 at the bad element, from the columns as they were then (w minus the
    updates of the earlier columns, rebuilt from the reference's err), and whether float64
    arithmetic instead of the spec's float32 gives another scale or code there."""
    w, u, bits, gs = args
    qmax = 2 ** (bits - 1) - 1
    r, c = m.index
    first = c if m.output == "scales" else c // gs
    codes, scales, err = _block_reference(w, u, bits, gs)
    cols = slice(first * gs, (first + 1) * gs)
    now = w[r, cols] - err[r, : first * gs] @ u[: first * gs, cols]  # the group at step 1
    amax = now.abs().max()
    s = scales[r, first]
    head = f"row {r}, group {first}: max|fp32(w)| = {num(amax.float())}, s = {num(s)}"
    if m.output != "codes":
        if (amax / qmax).float().half() != s:
            head += (f" (in float64, fp16(amax / {qmax}) = {num((amax / qmax).float().half())}"
                     ": take the float32 absmax and divide in float32)")
        return head
    sf = float(s) if s != 0 else 1.0
    wi = float(w[r, c] - err[r, :c] @ u[:c, c])
    head += f"; w[{r}, {c}] now = {num(wi)}, fp32(w) / s = {int_rounding(div32(wi, sf))}"
    if round(wi / sf) != round(div32(wi, sf)):
        head += f" (in float64, w / s = {wi / sf!r} rounds otherwise: divide in float32)"
    return head


def _block_compare(expected, got, args):
    """codes and fp16 scales bit-exact (one rounding each, on values computed in float64
    from the same inputs); err to 1e-9 of its largest value: the float64 updates may be
    summed in another order (e.g. a matmul over several columns at once), ~1e-15."""
    names = ("codes", "scales", "err")
    if type(got) is not tuple or len(got) != 3:
        return compare_values(expected, got, args, names=names)
    hint = compare_values(expected[:2], got[:2], args, names=names[:2], explain=_block_explain)
    if hint:
        return hint
    atol = 1e-9 * max(float(expected[2].abs().max()), 1e-30)
    return compare_values(expected[2], got[2], args, atol=atol, path="err")


task("gptq_block", "gptq_block", points=4, reference=_block_reference, compare=_block_compare,
     implements=("qlab.ptq.gptq.gptq_block", "qlab.ptq.gptq"),
     signature=("gptq_block(w float64 (N, B), u float64 (B, B), bits, group_size) -> "
                "(codes int8 (N, B), scales float16 (N, B // group_size), err float64 (N, B))")
     )(_block_cases)


# --------------------------------------------------------------------------- awq_scale


def _salient(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    """Activations (n, k) with a few channels 10-30x larger (outlier features), non-zero mean."""
    x = torch.randn(n, k, generator=g) + 0.3 * torch.randn(k, generator=g)
    big = torch.randperm(k, generator=g)[: randint(g, 1, 4)]
    x[:, big] *= 10 + 20 * torch.rand(len(big), generator=g)
    return x


def _awq_case(g: torch.Generator, alpha: float, dead: bool):
    gs = choice(g, (16, 32))
    k, n_out = gs * randint(g, 1, 4), randint(g, 4, 12)
    x = _salient(g, randint(g, 48, 128), k)
    if dead:
        x[:, torch.randperm(k, generator=g)[: randint(g, 1, 3)]] = 0.0  # A2
    w = torch.randn(n_out, k, generator=g) * choice(g, (0.02, 0.5))
    return (x, w, alpha, randint(g, 3, 4), gs)


def _awq_cases(g: torch.Generator):
    return [_awq_case(g, randint(g, 1, 19) / 20, False),
            _awq_case(g, randint(g, 1, 19) / 20, True),  # a dead channel, alpha > 0
            _awq_case(g, 0.0, randint(g, 0, 1) == 1)]  # alpha = 0: s = 1, RTN


def _awq_reference(x, w, alpha, bits, group_size):
    s = awq_scales(act_mean_abs(x), alpha)
    w_hat = awq_weight(w, s, f"int{bits}", group_size)
    return s, layer_error(w, w_hat, hessian(x.double()))  # the objective, float64


def _awq_compare(expected, got, args):
    """s: float32 pow / sqrt written another way differ by a few ulps (rtol 1e-6). err: a
    float32 x @ W^T - x @ W_hat^T loses ~1e-5 of the (small) difference to cancellation;
    qlab's value is float64, so rtol 1e-3. Wrong clauses move s or err by far more."""
    names = ("s", "err")
    if type(got) is not tuple or len(got) != 2:
        return compare_values(expected, got, args, names=names)
    return (compare_values(expected[0], got[0], args, rtol=1e-6, path="s")
            or compare_values(expected[1], got[1], args, rtol=1e-3, path="err"))


task("awq_scale", "awq_scale", points=3, reference=_awq_reference, compare=_awq_compare,
     implements=("qlab.ptq.awq.awq_scales", "qlab.ptq.awq.awq_weight", "qlab.ptq.awq"),
     signature=("awq_scale(x float32 (n, K), w float32 (N, K), alpha, bits, group_size) -> "
                "(s float32 (K,), err float)")
     )(_awq_cases)
