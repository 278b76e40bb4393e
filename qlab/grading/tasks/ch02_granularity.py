"""Chapter 02 (granularity): symmetric per-group quantization and the bits/weight it costs.

Spec clauses and the fixed case (every seed) that breaking each one changes:

group_quantize(w, bits, g) -> (codes int8 (R, K), scales fp16 (R, K // g))
  G1 groups of g contiguous elements along K, group j = k // g ..... "mixed groups" (and the
     outlier case: a per-tensor or per-row scale crushes the other groups)
  G2 scale = fp16(group amax / qmax) ................................. every nonzero group
  G6 the float32 amax divided, then rounded to fp16 (not fp16(amax)) . "mixed groups" (1, 0)
  G7 codes int8, scales float16 (the dtypes are graded) ............... every case
  G3 codes divide by the STORED fp16 scale .......................... "mixed groups" straddle
  G4 a true division, not x * (1 / s) ............................... "mixed groups" ties
  G5 round half to even ............................................. "mixed groups" ties
  G8 codes clamped to +-qmax: a subnormal fp16 scale (below 2^-14),
     rounded down, puts amax / s past qmax + 0.5 .................... "mixed groups" (1, 3)
  (G3, G4, G6 pin qlab.quantize's order on purpose, as in chapter 01: the spec's first sentence
  says so, and the feedback names w * (1 / s), the float32 scale or fp16(amax) where they differ)
  (with a normal fp16 scale the clamp never acts, as in chapter 01; the all-zero group, every
  run, must give scale 0 and codes 0, though a missing divide-by-1 guard is invisible there
  too)
bits_per_weight(bits, g, scale_bits, zero_bits) -> float
  B1 b + (scale_bits + zero_bits) / g: metadata amortised over g .... every case
  B2 zero_bits counted .............................................. zero_bits 4 and 8
  B3 a true division (not //) ....................................... (4, 128, 16, 4)
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Mismatch, close, exact, tasks_for
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

task = tasks_for("02_granularity")


def _group_explain(args, m: Mismatch) -> str:
    w, bits, gs = args
    qmax = 2 ** (bits - 1) - 1
    if m.output == "codes":
        r, k = m.index
        j = k // gs
    else:
        r, j = m.index
    scales = quantized(w, qlab.int_scheme(bits), gs)[1]
    group = w[r, j * gs : (j + 1) * gs]
    s = float(scales[r, j])
    head = (
        f"row {r}, group {j} = columns {j * gs}..{(j + 1) * gs - 1}: amax = "
        f"{num(group.abs().max())}, amax / {qmax} stored as float16: s = {num(s)}"
    )
    amax16 = group.abs().max().half().float()
    if (amax16 / qmax).half() != scales[r, j]:
        head += (f" (fp16(amax) / {qmax} = {num((amax16 / qmax).half())}: divide the float32 "
                 "amax, then round the quotient to float16)")
    if m.output != "codes":
        return head
    if s == 0:
        return head + " (an all-zero group: divide by 1, codes 0)"
    x = float(w[r, k])
    note = f"{head}; w = {num(x)}, w / s = {int_rounding(div32(x, s))}"
    if abs(round(div32(x, s))) > qmax:
        note += f", beyond the grid: the clamp gives {qmax if x > 0 else -qmax}"
    recip = float(torch.tensor(x) * (1 / torch.tensor(s)))
    if round(recip) != round(div32(x, s)):
        note += f" (w * (1 / s) = {num(recip)} rounds otherwise: divide)"
    s32 = float(group.abs().max() / qmax)
    if round(div32(x, s32)) != round(div32(x, s)):
        note += f" (w / the unrounded float32 scale = {num(div32(x, s32))}: divide by the fp16 s)"
    return note


@task("group_quantize", "group_quantize", points=3,
      implements=("qlab.quantize", "qlab.scales.absmax"),
      reference=lambda w, bits, group_size: quantized(w, qlab.int_scheme(bits), group_size),
      compare=exact(names=("codes", "scales"), explain=_group_explain),
      signature="group_quantize(w, bits, group_size) -> (codes int8, scales fp16 (R, K//g))")
def _group_cases(g: torch.Generator):
    cases = []
    for gs in (choice(g, (8, 16)), 32, choice(g, (4, 64))):
        rows, k = randint(g, 1, 5), gs * randint(g, 1, 4)
        if gs == 4:
            k = max(k, 8)
        w = weights(g, (rows, k), outliers=True)
        if k // gs > 1 and randint(g, 0, 1):
            w[0, :gs] = 0.0  # an all-zero group: scale 0, codes 0
        cases.append((w, randint(g, 2, 8), gs))
    # one large outlier in one group: per-tensor scaling would crush the others
    w = weights(g, (2, 64), scale=0.05)
    w[1, randint(g, 0, 63)] = 4.0
    cases.append((w, 4, 16))
    cases.append(_mixed_groups(g))
    return cases


def _mixed_groups(g: torch.Generator):
    """(2, 4 groups of 16): group (0, 0) holds exact ties on a trap scale (RNE, and x * (1/s)
    rounds the other way), group (0, 1) is all zeros, group (0, 2) a float16 straddle (its
    fp32 scale moves a code), group (1, 0) an absmax whose float16 rounding before the
    division changes the scale, group (1, 3) an absmax whose float16 scale is a subnormal
    rounded down (the clamp acts); the rest random, each group on its own scale."""
    bits, gs = randint(g, 5, 8), 16
    qmax = 2 ** (bits - 1) - 1
    w = weights(g, (2, 4 * gs)) * torch.logspace(-1, 1, 4).repeat_interleave(gs)
    k = randint(g, 1, min(qmax - 1, 31))
    step = reciprocal_trap(g, k) * 2.0 ** randint(g, -6, 0)
    ties = on_grid(g, (gs,), step, -qmax, qmax)
    ties[:8] = torch.tensor([0.5, 2.5, -1.5, -0.5, 1.5, -2.5, k + 0.5, qmax]) * step
    w[0, :gs] = ties
    w[0, gs : 2 * gs] = 0.0
    amax, xk = fp16_scale_straddle(g, qmax, qmax - 1)
    w[0, 2 * gs : 3 * gs] = (w[0, 2 * gs : 3 * gs] / w[0, 2 * gs : 3 * gs].abs().max()) * amax
    w[0, 2 * gs + randint(g, 0, gs - 2)] = xk
    w[0, 2 * gs + gs - 1] = -amax  # the group's amax, exactly
    amax = fp16_amax_trap(g, qmax)  # group (1, 0): fp16(fp16(amax) / qmax) is another scale
    w[1, :gs] = (w[1, :gs] / w[1, :gs].abs().max() * amax).clamp(-amax, amax)
    w[1, randint(g, 0, gs - 1)] = amax
    amax = qmax * fp16_subnormal_scale(g, qmax)  # group (1, 3): a subnormal fp16 scale
    w[1, 3 * gs :] = (w[1, 3 * gs :] / w[1, 3 * gs :].abs().max() * amax).clamp(-amax, amax)
    w[1, 3 * gs + randint(g, 0, gs - 1)] = -amax
    return (w, bits, gs)


# 1e-12: (s + z) / g and s / g + z / g may differ in the last bit of a float64
@task("bits_per_weight", "bits_per_weight", points=1,
      implements=("qlab.cost.bits_per_weight",),
      reference=lambda bits, g, sb, zb: qlab.cost.bits_per_weight(bits, g, sb, zb),
      compare=close(rtol=1e-12),
      signature="bits_per_weight(bits, group_size, scale_bits, zero_bits) -> float")
def _bpw_cases(g: torch.Generator):
    cases = [(4, 128, 16, 4)]  # (16 + 4) / 128: integer division would give 0
    for zero_bits in (0, 4, 8, choice(g, (0, 2, 4, 8)), randint(g, 1, 8)):
        cases.append(
            (
                randint(g, 2, 8),
                choice(g, (16, 32, 64, 128, 256, 96)),
                choice(g, (8, 16, 32)),
                zero_bits,
            )
        )
    return cases
