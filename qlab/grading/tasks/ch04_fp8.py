"""Chapter 04 (FP8): decode E4M3 from its bits; encode float32 to E4M3 (RNE, saturating)."""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Task, exact, register
from qlab.grading.tasks._inputs import choice, randint

ASSIGNMENT = "04_fp8"
E4M3 = "fp8_e4m3fn"


def _decode_cases(g: torch.Generator):
    cases = [(torch.randperm(256, generator=g).to(torch.uint8).reshape(16, 16),)]  # every code
    for _ in range(2):
        shape = (randint(g, 1, 5), randint(g, 1, 40))
        cases.append((torch.randint(0, 256, shape, generator=g).to(torch.uint8),))
    return cases


register(
    Task(
        grade_id="e4m3_decode",
        func_name="decode_e4m3",
        points=2,
        assignment=ASSIGNMENT,
        cases=_decode_cases,
        reference=lambda codes: qlab.formats.get(E4M3).decode(codes),
        # bit-exact: every E4M3 value is a float32; -0.0 must keep its sign, NaN matches NaN
        compare=exact(signed_zero=True),
        signature="decode_e4m3(codes uint8) -> float32 values",
    )
)


def _encode_cases(g: torch.Generator):
    fmt = qlab.formats.get(E4M3)
    vals = fmt.values  # ascending finite values
    cases = []
    # 1) spread over the whole range, both signs
    mag = torch.exp2(torch.empty(4, 32).uniform_(-12.0, 9.5, generator=g))
    sign = torch.where(torch.rand(4, 32, generator=g) < 0.5, -1.0, 1.0)
    cases.append((mag * sign,))
    # 2) exact ties halfway between neighbours (RNE), in the normal and subnormal ranges
    i = torch.randint(0, vals.numel() - 1, (3, 32), generator=g)
    mid = ((vals[i].double() + vals[i + 1].double()) / 2).float()
    cases.append((mid,))
    # 3) overflow: above 448 (saturates to +-448, no NaN), infinities, -0.0, tiny values
    big = torch.empty(2, 16).uniform_(448.0, 2000.0, generator=g) * choice(g, (1.0, -1.0))
    big[0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 464.0])
    big[1, :4] = torch.tensor([2.0**-10, -(2.0**-10), 2.0**-12, 480.0])
    cases.append((big,))
    return cases


register(
    Task(
        grade_id="e4m3_encode",
        func_name="encode_e4m3",
        points=3,
        assignment=ASSIGNMENT,
        cases=_encode_cases,
        reference=lambda x: qlab.formats.get(E4M3).encode(x),
        compare=exact(),
        signature="encode_e4m3(x float32) -> uint8 codes (RNE, saturate to +-448)",
    )
)
