"""Chapter 14 (quantization-aware training): the STE fake quantizer and LSQ's gradients.

A gradient task returns plain tensors: the learner's autograd.Function is called inside a
given wrapper that runs it forward and backward and returns (y, x.grad[, scale.grad]).

Spec clauses, and the fixed case (present on every seed) where breaking each one changes
the answer (tests/grading/mutants_ch14.py holds a mutant per clause):

ste_fake_quantize(x, bits, group_size, grad_y) -> (y, grad_x)
  T1 forward = qlab.fake_quantize(x, int{bits}, group_size): fp16 scale ... every case
  T2 round half to even ................................................ "edges", row 0
  T3 grad passes where -qmax*s <= x <= qmax*s, ends INCLUDED ........... "edges", row 0
  T4 grad 0 beyond: an fp16 scale rounded down clamps the max .......... "edges", row 1
  T5 the mask is on x itself, not on round(x / s) ...................... "edges", row 1
  T6 all-zero group: divide by 1, y = 0, the gradient passes ........... "edges", row 2
  T7 s = fp16(float32 amax / qmax), not fp16(fp16(amax) / qmax) ........ "amax trap"
  T8 u = x / s, a true division (not x * (1 / s)) ....................... "reciprocal"
  T9 y clamped to +-qmax s: a subnormal fp16 scale (below 2^-14),
     rounded down, puts amax / s past qmax + 0.5 ..................... "subnormal scale"
  (with a normal fp16 s the forward clamp never acts, as in chapter 01: |x / s| <=
  qmax (1 + 2^-11) < qmax + 0.5)
  (T7, T8 pin qlab.fake_quantize's order on purpose: the spec's first sentence says so, and the
  feedback names fp16(amax) / qmax and x * (1 / s) where they differ)
lsq_quantize(x, scale, bits, grad_scale, grad_y) -> (y, grad_x, grad_scale)
  L1 y = clamp(round(x / s), -Q, Q) * s, round half to even ............ "edges", ties
     (the clamp acts in "edges" row 1, whose step is 0.6 x its absmax one)
  L2 grad_x: STE inside [-Q s, Q s] (ends included), 0 beyond .......... "edges", row 0
  L3 ds: round(u) - u inside, -Q / +Q where clamped .................... every case
  L4 x == +-Q s exactly counts as inside (ds = 0, not +-Q) ............. "edges", row 0
  L5 summed over each group's elements, times grad_scale ............... every case
  L6 grad_scale is the argument (a random one), not LSQ's 1/sqrt(N Q) ... "edges", 3rd case
  L7 u = x / s, a true division (not x * (1 / s)) ....................... "reciprocal"
  L8 the range test compares x with the float32 products -Q s and Q s (not
     u = x / s with Q: a float32 scale's Q s rounds) ...................... "range ends"
  (L7, L8 pin qlab.qat.lsq_fake_quantize's order on purpose: the spec's first sentence says
  so, and the feedback names x * (1 / s) and u against Q where they decide otherwise; in the
  STE task s is a float16, Q s is exact in float32, and both range tests agree)
  (and an all-zero group, "edges" row 0: y = 0, no NaN, ds = 0; with the given scale > 0
  no rule above can break it, so it has no mutant of its own)
"""

from __future__ import annotations

import torch

from qlab.grading.registry import Mismatch, compare_values, exact, tasks_for
from qlab.grading.tasks._inputs import (
    choice,
    fp16_amax_trap,
    fp16_subnormal_scale,
    randint,
    reciprocal_trap,
    weights,
)
from qlab.grading.tasks._spec import div32, int_rounding, num
from qlab.qat import fake_quantize_ste, lsq_fake_quantize, lsq_grad_scale

task = tasks_for("14_qat")
EPS32 = 2.0**-24  # float32 unit roundoff


def _fp16_step(g: torch.Generator) -> float:
    """A random step that float16 holds exactly (11 significant bits), ~1e-3 .. 4e-2."""
    mantissa = randint(g, 1024, 2047)
    return mantissa * 2.0 ** (randint(g, -10, -5) - 10)


def _reciprocal_group(g: torch.Generator, n: int, qmax: int) -> tuple[torch.Tensor, float]:
    """(x (n,), s): an fp16 step s (amax qmax * s, exact) at which x = +-(k + 1/2) s divides
    to an exact tie while x * (1 / s) rounds to the other neighbour (qmax >= 2)."""
    k = randint(g, 1, min(qmax - 1, 31))
    s = reciprocal_trap(g, k) * 2.0 ** randint(g, -8, -4)
    x = torch.randint(-qmax, qmax + 1, (n,), generator=g).float() * s
    x[:3] = torch.tensor([qmax * s * choice(g, (1.0, -1.0)), (k + 0.5) * s, -(k + 0.5) * s])
    return x[torch.randperm(n, generator=g)], s


# --------------------------------------------------------------------------- STE


def _ste_group(g: torch.Generator, n: int, qmax: int, kind: str) -> torch.Tensor:
    """One group of n >= 4 values on half-steps of an fp16-exact step s (exact ties, among
    them +-s/2, where half-to-even and half-away differ), whose largest |x| sits exactly on
    / just beyond / just inside the end of the grid (kind "exact" / "down" / "up"), at a
    random place and with a random sign."""
    s = _fp16_step(g)
    rel = {"exact": 0.0, "down": 2.0**-13, "up": -(2.0**-13)}[kind]
    amax = torch.tensor(qmax * s * (1.0 + rel), dtype=torch.float64).float()
    steps = torch.randint(-2 * qmax + 1, 2 * qmax, (n,), generator=g).float()  # half-steps
    x = steps * (s / 2)  # exact: ties (k + 0.5) * s and grid points k * s, all inside
    where = torch.randperm(n, generator=g)[:3]
    x[where] = torch.stack([amax if randint(g, 0, 1) else -amax,
                            torch.tensor(s / 2), torch.tensor(-s / 2)])
    return x


def _ste_cases(g: torch.Generator):
    cases = []
    for _ in range(2):
        gs = choice(g, (8, 16, 32))
        x = weights(g, (randint(g, 1, 5), gs * randint(g, 1, 4)), outliers=True)
        cases.append((x, randint(g, 2, 8), gs, torch.randn(x.shape, generator=g)))
    bits, gs = randint(g, 2, 4), choice(g, (8, 16))
    qmax = 2 ** (bits - 1) - 1
    rows = [
        [_ste_group(g, gs, qmax, "exact"), _ste_group(g, gs, qmax, "exact")],  # T2, T3
        [_ste_group(g, gs, qmax, "down"), _ste_group(g, gs, qmax, "down")],  # T4, T5
        [_ste_group(g, gs, qmax, "up"), torch.zeros(gs)],  # inside; T6
    ]
    x = torch.stack([torch.cat(r) for r in rows])
    grad_y = torch.randn(x.shape, generator=g).sign() * (1.0 + torch.rand(x.shape, generator=g))
    cases.append((x, bits, gs, grad_y))
    bits, gs = randint(g, 3, 8), choice(g, (8, 16))  # amax trap: fp16(amax) / qmax is off
    amax = fp16_amax_trap(g, 2 ** (bits - 1) - 1)
    x = weights(g, (1, gs), scale=amax / 3).clamp(-amax, amax)
    x[0, randint(g, 0, gs - 1)] = amax * choice(g, (1.0, -1.0))
    cases.append((x, bits, gs, torch.randn(x.shape, generator=g)))
    bits, gs = randint(g, 3, 8), choice(g, (8, 16))  # reciprocal: x * (1 / s) moves a tie
    x = _reciprocal_group(g, gs, 2 ** (bits - 1) - 1)[0][None]
    cases.append((x, bits, gs, torch.randn(x.shape, generator=g)))
    bits, gs = randint(g, 3, 8), choice(g, (8, 16))  # subnormal scale: the clamp acts
    amax = (2 ** (bits - 1) - 1) * fp16_subnormal_scale(g, 2 ** (bits - 1) - 1)
    x = weights(g, (1, gs), scale=amax / 2).clamp(-amax, amax)
    x[0, randint(g, 0, gs - 1)] = amax * choice(g, (1.0, -1.0))
    cases.append((x, bits, gs, torch.randn(x.shape, generator=g)))
    return cases


def _ste_reference(x, bits, group_size, grad_y):
    x = x.clone().requires_grad_(True)
    y = fake_quantize_ste(x, f"int{bits}", group_size)
    y.backward(grad_y)
    return y.detach(), x.grad


def _ste_explain(args, m: Mismatch) -> str:
    """The group's fp16 scale, u = x / s and the STE range at the bad element of y or grad_x,
    naming fp16(amax) / qmax, x * (1 / s) and round(u) where they differ from the spec."""
    x, bits, group_size, _ = args
    qmax = 2 ** (bits - 1) - 1
    r, k = m.index
    group = x[r, k // group_size * group_size:(k // group_size + 1) * group_size]
    amax = group.abs().max()
    s = float((amax / qmax).half())
    note = (f"group {k // group_size} of row {r}: amax = {num(amax)}, s = fp16(amax / {qmax}) = "
            f"{num(s)}")
    s_early = float((amax.half().float() / qmax).half())
    if s_early != s:
        note += (f" (fp16(amax) / {qmax} would give s = {num(s_early)}: divide the float32 "
                 "absmax, then round the quotient to float16)")
    if s == 0:
        return note + " (an all-zero group: divide by 1, y = 0, the gradient passes)"
    xi, end = float(x[r, k]), float(torch.tensor(qmax, dtype=torch.float32) * s)
    note += f"; x = {num(xi)}, u = x / s = {int_rounding(div32(xi, s))}"
    if abs(round(div32(xi, s))) > qmax:
        note += f", beyond the grid: the clamp gives {qmax if xi > 0 else -qmax}"
    recip = float(torch.tensor(xi) * (1 / torch.tensor(s)))
    if round(recip) != round(div32(xi, s)):
        note += f" (x * (1 / s) = {num(recip)} rounds otherwise: divide)"
    if m.output == "grad_x":
        inside = -end <= xi <= end
        note += (f"; range [-{qmax} s, {qmax} s] = [{num(-end)}, {num(end)}] (ends included): "
                 f"x is {'inside, the gradient passes' if inside else 'outside, gradient 0'}")
        if inside != (abs(round(div32(xi, s))) <= qmax):
            note += " (testing round(u) instead of x itself decides otherwise)"
    return note


task("ste_fake_quantize", "ste_fake_quantize", points=3, reference=_ste_reference,
     implements=("qlab.qat.fake_quantize_ste",),
     compare=exact(names=("y", "grad_x"), explain=_ste_explain),
     signature="ste_fake_quantize(x (R, K), bits, group_size, grad_y (R, K)) -> (y, grad_x)"
     )(_ste_cases)


# --------------------------------------------------------------------------- LSQ


def _lsq_edge_case(g: torch.Generator):
    """Row 0: group 0 on an exact step with +-Q*s (inside), their next float32 outward
    (clamped) and half-step ties, +-s/2 among them; group 1 all zero. Row 1: a step 0.6x
    the absmax one (many values clamped). |grad_y| >= 1 everywhere, so each clause moves
    grad_scale."""
    bits, gs = randint(g, 2, 4), choice(g, (8, 16))
    qmax = 2 ** (bits - 1) - 1
    s = _fp16_step(g)
    steps = torch.randint(-2 * qmax + 1, 2 * qmax, (gs,), generator=g).float()
    grp = steps * (s / 2)  # half-steps: exact ties
    edge = torch.tensor([qmax * s, -qmax * s])
    grp[:6] = torch.cat([edge, torch.nextafter(edge, edge * 2), torch.tensor([s / 2, -s / 2])])
    row0 = torch.cat([grp[torch.randperm(gs, generator=g)], torch.zeros(gs)])
    row1 = weights(g, (2 * gs,))
    x = torch.stack([row0, row1])
    amax1 = row1.reshape(2, gs).abs().amax(dim=-1)
    scale = torch.stack([torch.tensor([s, s]), 0.6 * amax1 / qmax]).float()
    grad_y = torch.randn(x.shape, generator=g).sign() * (1.0 + torch.rand(x.shape, generator=g))
    grad_scale = float(torch.empty(()).uniform_(0.05, 2.0, generator=g))  # not LSQ's own
    return (x, scale, bits, grad_scale, grad_y)


def _lsq_cases(g: torch.Generator):
    cases = []
    for _ in range(2):
        bits, gs = randint(g, 2, 8), choice(g, (8, 16, 32))
        qmax = 2 ** (bits - 1) - 1
        x = weights(g, (randint(g, 1, 5), gs * randint(g, 1, 4)))
        amax = x.reshape(x.shape[0], -1, gs).abs().amax(dim=-1)
        factor = 0.3 + 1.2 * torch.rand(amax.shape, generator=g)  # some groups clamp
        scale = (factor * amax / qmax).float()
        cases.append((x, scale, bits, lsq_grad_scale(gs, qmax), torch.randn(x.shape, generator=g)))
    cases.append(_lsq_edge_case(g))
    bits, gs = randint(g, 3, 8), choice(g, (8, 16))  # reciprocal: x * (1 / s) moves a tie
    qmax = 2 ** (bits - 1) - 1
    row, s = _reciprocal_group(g, gs, qmax)
    grad_y = torch.randn(1, gs, generator=g)
    cases.append((row[None], torch.tensor([[s]]), bits, lsq_grad_scale(gs, qmax), grad_y))
    cases.append(_lsq_range_ends(g))
    return cases


def _lsq_range_ends(g: torch.Generator):
    """One group with a float32 step s whose product Q * s rounds in float32, and +-x_end
    on the side of that product where u = x / s compared with Q decides otherwise (the
    spec's float32 product Q s is the end of the range)."""
    bits, gs = randint(g, 3, 8), choice(g, (8, 16))
    qmax = 2 ** (bits - 1) - 1
    for _ in range(1000):
        s = torch.empty(()).uniform_(1e-3, 4e-2, generator=g)
        end = qmax * s  # the float32 product
        if end.double() == qmax * s.double():
            continue  # exact: both tests agree
        x_end = end if end.double() > qmax * s.double() else torch.nextafter(end, end * 2)
        if bool(x_end <= end) != bool(x_end / s <= qmax):
            x = (torch.rand(gs, generator=g) * 1.8 - 0.9) * end
            x[:2] = torch.stack([x_end, -x_end])
            x = x[torch.randperm(gs, generator=g)][None]
            grad_y = torch.randn(x.shape, generator=g).sign()
            grad_y = grad_y * (1 + torch.rand(x.shape, generator=g))  # |grad_y| >= 1
            return (x, s.reshape(1, 1), bits, lsq_grad_scale(gs, qmax), grad_y)
    raise RuntimeError("no float32 range-end trap for LSQ")


def _lsq_reference(x, scale, bits, grad_scale, grad_y):
    x = x.clone().requires_grad_(True)
    scale = scale.clone().requires_grad_(True)
    y = lsq_fake_quantize(x, scale, bits, grad_scale)
    y.backward(grad_y)
    return y.detach(), x.grad, scale.grad


def _lsq_explain(args, m: Mismatch) -> str:
    """u = x / s at the bad element of y or grad_x, naming a tie and x * (1 / s), and for
    grad_x the range test against the float32 product Q s."""
    x, scale, bits, _, _ = args
    qmax = 2 ** (bits - 1) - 1
    r, k = m.index
    s = float(scale[r, k // (x.shape[-1] // scale.shape[-1])])
    xi = float(x[r, k])
    end = float(torch.tensor(qmax, dtype=torch.float32) * torch.tensor(s))  # float32 Q s
    note = (f"x = {num(xi)}, s = {num(s)}, Q s = {num(end)} (float32), "
            f"u = x / s = {int_rounding(div32(xi, s))}")
    recip = float(torch.tensor(xi) * (1 / torch.tensor(s)))
    if round(recip) != round(div32(xi, s)):
        note += f" (x * (1 / s) = {num(recip)} rounds otherwise: divide)"
    if m.output == "grad_x":
        inside = -end <= xi <= end
        note += (f"; range [-Q s, Q s] (ends included): x is "
                 f"{'inside, the gradient passes' if inside else 'outside, gradient 0'}")
        if inside != (abs(div32(xi, s)) <= qmax):
            note += " (comparing u = x / s with Q decides otherwise: compare x with Q s)"
    return note


def _lsq_compare(expected, got, args):
    """y and grad_x bit-exact (one rounding each, the same in any correct code). grad_scale
    sums up to 32 products g * dL/dy * (round(u) - u): a float32 sum in another order, or u
    from another correctly rounded division, moves it by at most ~(n + 8) * 2^-24 of the sum
    of the magnitudes (first-order bound). The wrong answers are off by whole terms."""
    names = ("y", "grad_x", "grad_scale")
    if type(got) is not tuple or len(got) != 3:
        return compare_values(expected, got, args, names=names)  # says what shape it wanted
    hint = compare_values(expected[:2], got[:2], args, names=names[:2], explain=_lsq_explain)
    if hint:
        return hint
    x, scale, bits, grad_scale, grad_y = args
    qmax = 2 ** (bits - 1) - 1
    n = x.shape[-1] // scale.shape[-1]
    u = (x / torch.where(scale == 0, 1.0, scale).repeat_interleave(n, dim=-1)).abs()
    magnitude = (grad_y.abs() * (u + qmax)).reshape(*scale.shape, n).sum(dim=-1)
    atol = float(grad_scale * (n + 8) * EPS32 * magnitude.max())
    return compare_values(expected[2], got[2], args, atol=atol, path="grad_scale")


task("lsq_quantize", "lsq_quantize", points=3, reference=_lsq_reference, compare=_lsq_compare,
     implements=("qlab.qat.lsq_fake_quantize",),
     signature=("lsq_quantize(x (R, K), scale (R, G), bits, grad_scale, grad_y (R, K)) "
                "-> (y, grad_x, grad_scale (R, G))")
     )(_lsq_cases)
