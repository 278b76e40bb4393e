"""Chapter 03 (NF4): levels from normal quantiles; blockwise absmax NF4 quantization.

Spec clauses and the fixed case (every seed) that breaking each one changes:

nf4_levels(offset) -> 16 float32 levels
  L1 8 positive levels from 9 points offset..0.5, 7 negative from 8 .. every case
  L2 normalised by the largest level (span [-1, 1]) .................. every case
  L3 ascending order ................................................. every case
  L4 the offset is an argument (not QLoRA's pasted table) ............ the random offsets
  L5 returned as float32 (the dtype is graded) ....................... every case
  (float64 vs float32 arithmetic stays inside the 1e-6 tolerance: advice, not graded)
nf4_quantize(w) -> (codes uint8 (R, K), absmax float32 (R, K // 64))
  N1 blocks of 64 contiguous elements ................................ "blocks"
  N2 absmax per block, kept in float32 ............................... every case
  N3 u = w * fp32(1 / absmax): multiply by the reciprocal ............ "reciprocal"
  N4 u exactly on a midpoint takes the LOWER code .................... "midpoints"
  N5 an all-zero block: absmax 0, codes of level 0.0 (code 7) ........ "blocks"
  N6 codes uint8, absmax float32 (the dtypes are graded) ............. every case
  (midpoints summed in float32 equal qlab's fp32((l_k + l_k+1) / 2) for all 15: not a clause)
"""

from __future__ import annotations

import torch

import qlab
from qlab.formats import quantile_levels
from qlab.grading.registry import Mismatch, close, exact, tasks_for
from qlab.grading.tasks._inputs import choice, randint, rounding_splits, weights
from qlab.grading.tasks._spec import nf4_rounding, num, quantized

task = tasks_for("03_nf4")
NF4 = qlab.formats.get("nf4")
BLOCK = 64


# 1e-6: different implementations of the normal quantile function (torch.special.ndtri,
# statistics.NormalDist, scipy) agree to ~1e-15 in float64 but a float32 level may
# still land one ulp (6e-8) apart; 1e-6 is far below the 0.08 gap between levels.
@task("nf4_levels", "nf4_levels", points=2, reference=lambda offset: quantile_levels(offset),
      implements=("qlab.formats.nf4.quantile_levels",),
      compare=close(rtol=0.0, atol=1e-6),
      signature="nf4_levels(offset) -> 16 float32 levels, ascending, in [-1, 1]")
def _levels_cases(g: torch.Generator):
    # a fresh offset each time (bitsandbytes uses 0.9677083), so a pasted table cannot pass
    offsets = torch.empty(3).uniform_(0.93, 0.995, generator=g)
    return [(float(o),) for o in offsets] + [(0.9677083,)]


def _nf4_explain(args, m: Mismatch) -> str:
    (w,) = args
    r, k = m.index
    j = k // BLOCK if m.output == "codes" else k
    block = w[r, j * BLOCK : (j + 1) * BLOCK]
    a = block.abs().max()
    head = f"row {r}, block {j} = columns {j * BLOCK}..{(j + 1) * BLOCK - 1}: absmax = {num(a)}"
    if m.output != "codes":
        return head
    if a == 0:
        return head + " (an all-zero block: reciprocal 0, u = 0, the code of level 0.0)"
    inv = 1.0 / a  # float32, as bitsandbytes
    u = float(w[r, k] * inv)
    return f"{head}, fp32(1 / absmax) = {num(inv)}; w = {num(w[r, k])}, " + nf4_rounding(u)


@task("nf4_quantize", "nf4_quantize", points=3, reference=lambda w: quantized(w, "nf4"),
      implements=("qlab.quantize", "qlab.scales.nf4", "qlab.formats.nf4.NF4Grid.encode"),
      compare=exact(names=("codes", "absmax"), explain=_nf4_explain),
      signature="nf4_quantize(w) -> (codes uint8 (R, K), absmax float32 (R, K // 64))")
def _nf4_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        rows, k = randint(g, 1, 4), BLOCK * randint(g, 1, 3)
        cases.append((weights(g, (rows, k), outliers=bool(randint(g, 0, 1))),))
    # blocks: 2 rows of 3 blocks on very different scales, one block all zeros
    w = weights(g, (2, 3 * BLOCK)) * torch.tensor([0.1, 1.0, 10.0]).repeat_interleave(BLOCK)
    r, j = randint(g, 0, 1), randint(g, 0, 2)
    w[r, j * BLOCK : (j + 1) * BLOCK] = 0.0
    cases.append((w,))
    # values exactly on the fp32 midpoints (absmax 1): bitsandbytes takes the LOWER code
    w = NF4.midpoints[torch.randint(0, 15, (2, BLOCK), generator=g)].clone()
    w[:, 0] = 1.0
    cases.append((w,))
    cases.append((_reciprocal_block(g),))
    return cases


def _reciprocal_block(g: torch.Generator) -> torch.Tensor:
    """One block where w * fp32(1 / absmax) and w / absmax fall on different sides of a
    midpoint (a few ulps around midpoint * absmax), for an absmax that is no power of two."""
    for _ in range(200):
        a = torch.empty(()).uniform_(0.1, 4.0, generator=g)
        spec, wrong = (lambda v, a=a: NF4.encode(v * (1.0 / a))), (lambda v, a=a: NF4.encode(v / a))
        hits = rounding_splits(spec, wrong, NF4.midpoints * a, g)
        hits = hits[hits.abs() < a][:8]
        if hits.numel():
            w = weights(g, (1, BLOCK), scale=float(a) / 4).clamp(-a, a)
            w[0, 1 : 1 + hits.numel()] = hits
            w[0, 0] = a * choice(g, (1.0, -1.0))
            return w
    raise RuntimeError("no reciprocal-vs-division split found for NF4")
