"""Chapter 04 (FP8): decode E4M3 from its bits; encode float32 to E4M3 (RNE, saturating).

Spec clauses and the fixed case (every seed) that breaking each one changes:

e4m3_decode(codes uint8) -> float32
  F1 2^(E-7) (1 + M/8) for E > 0 .................................... every code, every run
  F2 E = 0 is subnormal: 2^-6 * M/8 ................................. every code
  F3 0x7F and 0xFF are NaN, and only they (0x7E = 448, no inf) ...... every code
  F4 the sign bit applies to zero: 0x80 is -0.0 ..................... every code
  F5 float32 values (the dtype is graded) ............................ every case
e4m3_encode(x float32) -> uint8
  C1 nearest value ................................................... spread
  C2 ties to the even code, normal range (both directions) .......... "ties"
  C3 ties to even in the subnormal range (2^-10 -> 0) ............... "ties"
  C4 saturation: |x| > 448, inf included, gives +-448, never NaN .... "overflow"
  C5 the sign bit is x's sign bit: -0.0 and -tiny give 0x80 ......... "overflow"
  C6 uint8 codes (the dtype is graded) ............................... every case
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Mismatch, exact, tasks_for
from qlab.grading.tasks._inputs import choice, randint
from qlab.grading.tasks._spec import grid_rounding

task = tasks_for("04_fp8")
E4M3 = qlab.formats.get("fp8_e4m3fn")
# exact ties, by hand: 1.0625 -> 1.0 (0x38) and 1.1875 -> 1.25 (0x3A), 15.5 -> 16 (0x58),
# 2^-10 -> 0 and 3 * 2^-10 -> 2^-8 (0x02), both signs: round half up/away/down all differ
TIES = (1.0625, -1.1875, 15.5, -(2.0**-10), 3 * 2.0**-10, 1.0625 * 2.0**-5, -50.0)


def _decode_explain(args, m: Mismatch) -> str:
    f = E4M3.fields(int(args[0][m.index]))
    kind = "subnormal: 2^-6 * M/8" if f["subnormal"] else "normal: 2^(E-7) * (1 + M/8)"
    if f["exponent"] == 15 and f["mantissa"] == 7:
        kind = "E = 15 and M = 7: the only NaN codes, 0x7F and 0xFF"
    return (
        f"code 0x{f['code']:02X} = S.EEEE.MMM {f['bits']}: S={f['sign']}, E={f['exponent']}, "
        f"M={f['mantissa']} ({kind}) -> {f['value']!r}"
    )


# bit-exact: every E4M3 value is a float32; -0.0 must keep its sign, NaN matches NaN
@task("e4m3_decode", "decode_e4m3", points=2, reference=lambda codes: E4M3.decode(codes),
      implements=("qlab.formats.minifloat.Minifloat.decode",),
      compare=exact(signed_zero=True, explain=_decode_explain),
      signature="decode_e4m3(codes uint8) -> float32 values")
def _decode_cases(g: torch.Generator):
    cases = [(torch.randperm(256, generator=g).to(torch.uint8).reshape(16, 16),)]  # every code
    for _ in range(2):
        shape = (randint(g, 1, 5), randint(g, 1, 40))
        cases.append((torch.randint(0, 256, shape, generator=g).to(torch.uint8),))
    return cases


@task("e4m3_encode", "encode_e4m3", points=3, reference=lambda x: E4M3.encode(x),
      implements=("qlab.formats.minifloat.Minifloat.encode",
                  "qlab.formats.minifloat.Minifloat.encode_generic",),
      compare=exact(explain=lambda args, m: "x = " + grid_rounding(float(args[0][m.index]), E4M3)),
      signature="encode_e4m3(x float32) -> uint8 codes (RNE, saturate to +-448)")
def _encode_cases(g: torch.Generator):
    vals = E4M3.values  # ascending finite values
    cases = []
    # 1) spread over the whole range, both signs
    mag = torch.exp2(torch.empty(4, 32).uniform_(-12.0, 9.5, generator=g))
    sign = torch.where(torch.rand(4, 32, generator=g) < 0.5, -1.0, 1.0)
    cases.append((mag * sign,))
    # 2) ties: the fixed ones, then random midpoints between neighbours (normal, subnormal)
    i = torch.randint(0, vals.numel() - 1, (3, 32), generator=g)
    mid = ((vals[i].double() + vals[i + 1].double()) / 2).float()
    mid[0, : len(TIES)] = torch.tensor(TIES)
    cases.append((mid,))
    # 3) overflow: above 448 (saturates to +-448, no NaN), infinities, -0.0, tiny values
    big = torch.empty(2, 16).uniform_(448.0, 2000.0, generator=g) * choice(g, (1.0, -1.0))
    big[0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 464.0])
    big[1, :4] = torch.tensor([2.0**-10, -(2.0**-12), 2.0**-12, -480.0])
    cases.append((big,))
    return cases
