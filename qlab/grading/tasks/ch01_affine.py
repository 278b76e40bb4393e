"""Chapter 01 (affine quantization): symmetric, asymmetric, dequantize. Per tensor.

Spec clauses, and the fixed case (present on every seed) in which breaking each one
changes the answer (tests/grading/grading_bank.py holds a mutant per clause):

sym_quantize(x, bits) -> (codes int8, scale fp16 0-d)
  S1 grid -qmax..qmax, qmax = 2^(b-1) - 1 .......................... every case
  S2 scale = fp16(amax / qmax), stored as float16 ................... every nonzero case
  S6 the float32 amax divided, then rounded to fp16 (not fp16(amax)) . "amax trap"
  S7 codes int8, scale float16 (the dtypes are graded) ............... every case
  S3 codes divide by the STORED fp16 scale, not the fp32 one ........ "fp16 straddle"
  S4 a true division x / s, not x * (1 / s) ......................... "ties" (trap scale)
  S5 round half to even, both signs ................................. "ties"
  S8 codes clamped to +-qmax: a scale below 2^-14 is a float16
     subnormal, rounded down by up to a third, so |x / s| passes
     qmax + 0.5 .................................................... "subnormal scale"
  (S3, S4, S6, A7, A8, A9 pin qlab.quantize's order on purpose: the spec's first sentence says
  so and why, and the feedback names x * (1 / s), the float32 scale, fp16(amax) or
  fp16(hi - lo) where they differ)
  (with a normal float16 scale the clamp never acts: |x / s| <= qmax (1 + 2^-11) < qmax + 0.5;
  an all-zero tensor ("zeros", every run) must give scale 0 and codes 0, but without the
  divide-by-1 guard 0 / 0 = NaN casts to code 0 on this torch: the guard is advice, not graded)
asym_quantize(x, bits) -> (codes uint8, scale fp16, zero_point uint8)
  A1 range includes 0: lo = min(x, 0), hi = max(x, 0) ............... all >= 0 / all <= 0
  A2 scale = fp16((hi - lo) / (2^b - 1)) ............................ every case
  A3 z = round(-lo / s) with the STORED scale ....................... "fp16 straddle"
  A4 z rounds half to even .......................................... "z tie, k even"
  A5 codes = round(x / s) + z: round first (z odd moves RNE ties) ... "code ties, z odd"
  A6 codes clamped to [0, 2^b - 1] (a tie can reach 2^b) ............ "z tie, k odd"
  A7 codes divide by the stored fp16 scale .......................... "fp16 straddle"
  A8 a true division x / s, not x * (1 / s) ......................... "reciprocal"
  A9 s = fp16(float32 (hi - lo) / (2^b - 1)), rounded once: not lo, hi
     or hi - lo rounded to fp16 first, nor float16 arithmetic ........ "span trap"
  A10 codes uint8, scale float16, zero point uint8 or an int (graded) every case
  A11 z clamped to [0, 2^b - 1]: a subnormal float16 scale (below
      2^-14) rounded down makes -lo / s pass 2^b - 1 + 0.5 ........... "subnormal scale"
  (a range whose scale overflows float16 or rounds to 0 cannot be stored: qlab.quantize raises
  ValueError there, the spec says so, and no case draws one; a subnormal float16 scale is
  stored like any other)
  (with a normal float16 scale z's clamp never acts: -lo / s <= (2^b - 1)(1 + 2^-11) rounds to
  <= 2^b - 1; the all-zero tensor, every run, is checked but its guard invisible, as for S)
affine_dequantize(codes, scale, z) -> float32
  D1 x_hat = s * (q - z) with q - z signed (no uint8 wrap-around) ... "q < z"
  D2 in float32 (an fp16 product rounds) ............................ "fp16 product"
  D3 a float32 result (the dtype is graded) ......................... every case
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Mismatch, exact, tasks_for
from qlab.grading.tasks._inputs import (
    choice,
    fp16_amax_trap,
    fp16_scale_straddle,
    fp16_subnormal_scale,
    on_grid,
    randint,
    reciprocal_trap,
    weights,
)
from qlab.grading.tasks._spec import div32, int_rounding, num, quantized

task = tasks_for("01_affine")
TIES = (0.5, 2.5, -1.5, -0.5, 1.5, -2.5)  # RNE: 0, 2, -2, -0, 2, -2; half-up/away differ


def _sym_explain(args, m: Mismatch) -> str:
    x, bits = args
    qmax = 2 ** (bits - 1) - 1
    scale = quantized(x, qlab.int_scheme(bits))[1]
    s32 = torch.as_tensor(float(x.abs().max()), dtype=torch.float32) / qmax
    s = float(scale)
    head = f"qmax = {qmax}, amax / qmax = {num(s32)} in float32, stored as float16: s = {num(s)}"
    amax16 = torch.as_tensor(float(x.abs().max())).half().float()
    if (amax16 / qmax).half() != scale:
        head += (f" (fp16(amax) / qmax = {num((amax16 / qmax).half())}: divide the float32 "
                 "absmax, then round the quotient to float16)")
    if m.output != "codes":
        return head
    if s == 0:
        return head + " (an all-zero tensor: divide by 1, codes 0)"
    xi = float(x[m.index])
    note = f"{head}; x = {num(xi)}, x / s = {int_rounding(div32(xi, s))}"
    if abs(round(div32(xi, s))) > qmax:
        note += f", beyond the grid: the clamp gives {qmax if xi > 0 else -qmax}"
    recip = float(torch.tensor(xi) * (1 / torch.tensor(s)))
    if round(recip) != round(div32(xi, s)):
        note += f" (x * (1 / s) = {num(recip)} rounds otherwise: divide)"
    if round(div32(xi, s32)) != round(div32(xi, s)):
        note += f" (x / the unrounded float32 scale = {num(div32(xi, s32))}: divide by the fp16 s)"
    return note


@task("sym_quantize", "symmetric_quantize", points=2,
      implements=("qlab.quantize", "qlab.scales.absmax"),
      reference=lambda x, bits: quantized(x, qlab.int_scheme(bits)),
      compare=exact(names=("codes", "scale"), explain=_sym_explain),
      signature="symmetric_quantize(x, bits) -> (codes int8, scale float16 0-d)")
def _sym_cases(g: torch.Generator):
    cases = []
    for _ in range(3):  # random weights, random width
        shape = (randint(g, 1, 4), choice(g, (8, 16, 24)))
        cases.append((weights(g, shape, outliers=bool(randint(g, 0, 1))), randint(g, 2, 8)))
    # ties: scale exactly `step` (amax = qmax * step), x on half-steps, both signs; the trap
    # scale makes x * (1 / s) round the other way at (k + 0.5) * s
    bits = randint(g, 4, 8)
    qmax = 2 ** (bits - 1) - 1
    k = randint(g, 1, min(qmax - 1, 31))
    step = reciprocal_trap(g, k) * 2.0 ** randint(g, -6, 1)
    x = on_grid(g, (4, 16), step, -qmax, qmax)
    x[0, :8] = torch.tensor([*TIES, 0.75, k + 0.5]) * step
    x[1, randint(g, 0, 15)] = qmax * step * choice(g, (1.0, -1.0))
    cases.append((x, bits))
    # fp16 straddle: dividing by the fp32 scale instead of the stored fp16 one moves a code
    bits = randint(g, 5, 8)
    qmax = 2 ** (bits - 1) - 1
    amax, xk = fp16_scale_straddle(g, qmax, qmax - 1)
    x = weights(g, (2, 16), scale=amax / 4).clamp(-amax, amax)
    x[0, 3], x[1, 7] = xk, -amax
    cases.append((x, bits))
    # amax trap: fp16(fp16(amax) / qmax) != fp16(amax / qmax), so rounding the absmax to
    # float16 before the division changes the stored scale
    bits = randint(g, 3, 8)
    amax = fp16_amax_trap(g, 2 ** (bits - 1) - 1)
    x = weights(g, (2, 8), scale=amax / 4).clamp(-amax, amax)
    x[randint(g, 0, 1), randint(g, 0, 7)] = amax * choice(g, (1.0, -1.0))
    cases.append((x, bits))
    # subnormal scale: s = fp16(amax / qmax) = k 2^-24 with amax / qmax = (k + u) 2^-24
    bits = randint(g, 3, 8)
    qmax = 2 ** (bits - 1) - 1
    amax = qmax * fp16_subnormal_scale(g, qmax)
    x = weights(g, (2, 8), scale=amax / 2).clamp(-amax, amax)
    x[randint(g, 0, 1), randint(g, 0, 7)] = amax * choice(g, (1.0, -1.0))
    cases.append((x, bits))
    cases.append((torch.zeros(2, 8), randint(g, 2, 8)))  # zeros: scale 0, codes 0
    return cases


def _asym_explain(args, m: Mismatch) -> str:
    x, bits = args
    levels = 2**bits - 1
    _, scale, zero = quantized(x, qlab.int_scheme(bits, symmetric=False), fields=_ASYM)
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    s, z = float(scale), int(zero)
    s32 = float((torch.tensor(hi, dtype=torch.float32) - lo) / levels)
    head = (
        f"lo = min(x, 0) = {num(lo)}, hi = max(x, 0) = {num(hi)}, (hi - lo) / {levels} = "
        f"{num(s32)}, stored as float16: s = {num(s)}"
    )
    lo16, hi16 = (torch.tensor(v, dtype=torch.float16) for v in (lo, hi))
    early = {  # the scale from values rounded to float16 before the division
        "fp16(hi - lo)": (torch.tensor(hi, dtype=torch.float32) - lo).half().float() / levels,
        "(fp16(hi) - fp16(lo))": (hi16.float() - lo16.float()) / levels,
    }
    for what, v in early.items():
        if float(v.half()) != s:
            head += (f" ({what} / {levels} = {num(v.half())}: divide the float32 hi - lo, then "
                     "round the quotient to float16 once)")
            break
    if s == 0:
        return head + " (an all-zero tensor: divide by 1, z = 0, codes 0)"
    if m.output == "scale":
        return head
    head += f"; -lo / s = {int_rounding(div32(-lo, s))}, so z = {z}"
    v = -lo if m.output != "codes" else float(x[m.index])
    if m.output == "codes":
        head += f"; x = {num(v)}, x / s = {int_rounding(div32(v, s))}, + z, clamp to [0, {levels}]"
        recip = float(torch.tensor(v) * (1 / torch.tensor(s)))
        if round(recip) != round(div32(v, s)):
            head += f" (x * (1 / s) = {num(recip)} rounds otherwise: divide)"
    if round(div32(v, s32)) != round(div32(v, s)):
        head += f" (over the unrounded float32 scale: {num(div32(v, s32))}; use the fp16 s)"
    return head


_ASYM = ("codes", "scales", "zero_points")


@task("asym_quantize", "asymmetric_quantize", points=2,
      implements=("qlab.quantize", "qlab.scales.minmax"),
      reference=lambda x, bits: quantized(x, qlab.int_scheme(bits, symmetric=False), fields=_ASYM),
      compare=exact(names=("codes", "scale", "zero_point"), explain=_asym_explain),
      signature="asymmetric_quantize(x, bits) -> (codes uint8, scale float16, zero_point uint8)")
def _asym_cases(g: torch.Generator):
    cases = []
    for sign in (0, 1, -1):  # mixed, all >= 0 (after ReLU), all <= 0
        bits = randint(g, 2, 8)
        x = weights(g, (randint(g, 1, 4), choice(g, (8, 16, 32))))
        if sign:
            x = sign * x.abs()
        x = x + (0.25 * float(x.abs().max()) if sign == 0 and randint(g, 0, 1) else 0.0)
        cases.append((x, bits))
    cases.append(_asym_code_ties(g))
    for parity in (0, 1):
        cases.append(_asym_zero_tie(g, parity))
    cases.append(_asym_straddle(g))
    cases.append(_asym_reciprocal(g))
    cases.append(_asym_span_trap(g))
    cases.append(_asym_subnormal(g))
    cases.append((torch.zeros(1, 8), randint(g, 2, 8)))
    return cases


def _asym_code_ties(g: torch.Generator):
    """Range [-z s, (levels - z) s] with an exact scale and an ODD integer z: the code ties
    x / s = t + 0.5 round to even before z is added (round(x / s + z) differs)."""
    bits = randint(g, 3, 8)
    levels = 2**bits - 1
    z = 2 * randint(g, 1, (levels - 4) // 2) + 1  # odd, 3 <= z <= levels - 3
    step = 2.0 ** randint(g, -5, 1)
    x = on_grid(g, (3, 16), step, -z, levels - z)
    x[0, :8] = torch.tensor([-z, levels - z, *TIES]) * step
    return (x, bits)


def _asym_zero_tie(g: torch.Generator, parity: int):
    """-lo / s = k + 0.5 exactly (a tie for z). k even: RNE keeps k (half-up gives k + 1).
    k odd: z = k + 1 and x = hi rounds to levels - k, so the code reaches 2^b and the clamp
    to 2^b - 1 acts."""
    bits = randint(g, 3, 8)
    levels = 2**bits - 1
    k = 2 * randint(g, 0, (levels - 3) // 2) + parity
    step = 2.0 ** randint(g, -5, 1)
    lo, hi = -(k + 0.5) * step, (levels - k - 0.5) * step  # hi - lo = levels * step
    x = lo + (hi - lo) * torch.rand(2, 16, generator=g)
    x[0, 0], x[1, 5] = lo, hi
    return (x, bits)


def _asym_reciprocal(g: torch.Generator):
    """Range [-z s, (levels - z) s] with a float16 scale s (exact) at which x = +-(k + 0.5) s
    divides to an exact tie while x * (1 / s) rounds to the other neighbour."""
    bits = randint(g, 5, 8)
    levels = 2**bits - 1
    k = randint(g, 1, min(15, (levels - 2) // 2))  # so that k + 1 <= levels - k - 1
    s = reciprocal_trap(g, k) * 2.0 ** randint(g, -6, 0)
    z = randint(g, k + 1, levels - k - 1)  # both ties +-(k + 0.5) s lie inside the range
    lo, hi = -z * s, (levels - z) * s
    x = (lo + (hi - lo) * torch.rand(2, 16, generator=g)).clamp(lo, hi)
    x[0, 0], x[0, 1], x[1, 2], x[1, 3] = lo, hi, (k + 0.5) * s, -(k + 0.5) * s
    return (x, bits)


def _asym_subnormal(g: torch.Generator):
    """x <= 0 with (hi - lo) / levels a float32 quotient that float16 stores as a subnormal
    rounded down by over a tenth: -lo / s rounds past 2^b - 1, so z's clamp acts (and the
    codes' clamp at 0)."""
    bits = randint(g, 3, 8)
    levels = 2**bits - 1
    lo = -levels * fp16_subnormal_scale(g, levels)
    x = lo * torch.rand(2, 8, generator=g)
    x[randint(g, 0, 1), randint(g, 0, 7)] = lo
    return (x, bits)


def _asym_span_trap(g: torch.Generator):
    """A range [lo, hi] (lo = -t, t a float16, hi - lo exact in float32) whose scale
    fp16((hi - lo) / levels) differs from the one computed after rounding hi - lo, or lo and
    hi, to float16 first (in float32 or in float16 arithmetic)."""
    bits = randint(g, 3, 8)
    levels = 2**bits - 1
    for _ in range(400):
        span = torch.empty(()).uniform_(0.5, 4.0, generator=g)
        t = randint(g, 1, 255) * 2.0**-9  # a float16, so lo = -t is one
        lo, hi = torch.tensor(-t), span - t
        if t >= float(span) or hi - lo != span:
            continue
        spec = (span / levels).half()
        early = (
            (span.half().float() / levels).half(),  # hi - lo rounded first
            ((hi.half().float() - lo) / levels).half(),  # lo and hi rounded first
            (hi.half() - lo.half()) / levels,  # float16 arithmetic throughout
        )
        if all(v != spec for v in early):
            x = (lo + span * torch.rand(2, 16, generator=g)).clamp(lo, hi)
            x[0, randint(g, 0, 15)], x[1, randint(g, 0, 15)] = lo, hi
            return (x, bits)
    raise RuntimeError("no float16 span trap for the asymmetric scale")


def _asym_straddle(g: torch.Generator):
    """A range whose scale is not a float16: z and a code from the fp32 scale differ."""
    bits = randint(g, 6, 8)
    levels = 2**bits - 1
    for _ in range(200):
        span = torch.empty(()).uniform_(0.5, 4.0, generator=g)
        s32 = span / levels
        s16 = s32.to(torch.float16).float()
        kz = randint(g, levels // 2, levels - 2)
        lo = -(kz + 0.5) * (s16 + s32) / 2
        hi = lo + span
        s32, s16 = (hi - lo) / levels, ((hi - lo) / levels).to(torch.float16).float()
        xc = (levels - kz - 1.5) * (s16 + s32) / 2  # a code on the positive side
        if all(torch.round(v / s16) != torch.round(v / s32) for v in (-lo, xc)):
            x = lo + (hi - lo) * torch.rand(2, 16, generator=g)
            x[0, 0], x[0, 1], x[1, 2] = lo, hi, xc
            return (x, bits)
    raise RuntimeError("no float16 straddle for the zero point")


def _deq_explain(args, m: Mismatch) -> str:
    codes, scale, zero = args
    q, z, s = int(codes[m.index]), int(zero), float(scale)
    prod = float(torch.tensor(s, dtype=torch.float32) * (q - z))
    return f"q = {q}, z = {z}, q - z = {q - z} (signed), s = {num(s)}, s * (q - z) = {num(prod)}"


@task("affine_dequantize", "affine_dequantize", points=1,
      implements=("qlab.dequantize",),
      reference=lambda codes, scale, zero_point: _deq_ref(codes, scale, zero_point),
      compare=exact(explain=_deq_explain),
      signature="affine_dequantize(codes, scale, zero_point) -> float32 x_hat")
def _deq_cases(g: torch.Generator):
    cases = []
    for _ in range(4):
        bits = randint(g, 2, 8)
        qmax = 2**bits - 1
        shape = (randint(g, 1, 4), choice(g, (4, 8, 16)))
        codes = torch.randint(0, qmax + 1, shape, generator=g).to(torch.uint8)
        scale = torch.empty(()).uniform_(1e-3, 2.0, generator=g).to(torch.float16)
        zero = torch.tensor(randint(g, 0, qmax), dtype=torch.uint8)
        cases.append((codes, scale, zero))
    # every 8-bit code, z in the middle (q < z wraps in uint8), and a scale with all 11
    # significant bits, so s * (q - z) needs more bits than float16 has
    codes = torch.randperm(256, generator=g).to(torch.uint8).reshape(8, 32)
    mantissa = 1 + (2 * randint(g, 0, 511) + 1) / 1024  # odd last mantissa bit
    scale = torch.tensor(mantissa * 2.0 ** randint(g, -8, -2), dtype=torch.float16)
    cases.append((codes, scale, torch.tensor(randint(g, 64, 192), dtype=torch.uint8)))
    return cases


def _deq_ref(codes, scale, zero_point):
    bits = 8  # the stored code width does not change scale * (q - z)
    qt = qlab.QTensor(
        codes=codes,
        scales=scale,
        zero_points=zero_point,
        scheme=qlab.int_scheme(bits, symmetric=False),
        granularity="tensor",
    )
    return qlab.dequantize(qt)
