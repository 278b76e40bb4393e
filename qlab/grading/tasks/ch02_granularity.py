"""Chapter 02 (granularity): symmetric per-group quantization and the bits/weight it costs."""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Task, close, exact, register
from qlab.grading.tasks._inputs import choice, randint, weights

ASSIGNMENT = "02_granularity"


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
    return cases


def _group_ref(w, bits, group_size):
    qt = qlab.quantize(w, qlab.int_scheme(bits), group_size)
    return qt.codes, qt.scales


register(
    Task(
        grade_id="group_quantize",
        func_name="group_quantize",
        points=3,
        assignment=ASSIGNMENT,
        cases=_group_cases,
        reference=_group_ref,
        compare=exact(names=("codes", "scales")),
        signature="group_quantize(w, bits, group_size) -> (codes int8, scales fp16 (R, K//g))",
    )
)


def _bpw_cases(g: torch.Generator):
    cases = []
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


register(
    Task(
        grade_id="bits_per_weight",
        func_name="bits_per_weight",
        points=1,
        assignment=ASSIGNMENT,
        cases=_bpw_cases,
        reference=lambda bits, g, sb, zb: qlab.cost.bits_per_weight(bits, g, sb, zb),
        # 1e-12: (s + z) / g and s / g + z / g may differ in the last bit of a float64
        compare=close(rtol=1e-12),
        signature="bits_per_weight(bits, group_size, scale_bits, zero_bits) -> float",
    )
)
