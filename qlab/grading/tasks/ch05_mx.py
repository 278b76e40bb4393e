"""Chapter 05 (microscaling): the MX shared scale of each block; MXFP4 quantization."""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Task, exact, register
from qlab.grading.tasks._inputs import choice, randint, weights

ASSIGNMENT = "05_mx"
ELEMENTS = {
    "fp4_e2m1fn": "mxfp4",
    "fp6_e2m3fn": "mxfp6_e2m3",
    "fp6_e3m2fn": "mxfp6_e3m2",
    "fp8_e4m3fn": "mxfp8_e4m3",
    "fp8_e5m2": "mxfp8_e5m2",
}
BLOCK = 32  # OCP MX v1.0: k = 32


def _blocks(g: torch.Generator, n_blocks_max: int = 4):
    rows, k = randint(g, 1, 4), BLOCK * randint(g, 1, n_blocks_max)
    x = weights(g, (rows, k), outliers=bool(randint(g, 0, 1)))
    return x


def _scale_cases(g: torch.Generator):
    cases = []
    for _ in range(2):
        cases.append((_blocks(g), choice(g, list(ELEMENTS))))
    # amax just below / exactly at powers of two (log2 would round up below 2^e)
    x = weights(g, (3, 3 * BLOCK), scale=0.1)
    # e not in -1..2: there float32 log2 of the float just below 2^e rounds up to exactly e
    e = choice(g, (-6, -4, -3, -2, 3, 4, 5))
    x[:2] *= 2.0**e / (2 * float(x[:2].abs().max()))  # rows 0-1 below 2^(e-1) ...
    x[0, 5] = torch.nextafter(torch.tensor(2.0**e), torch.tensor(0.0))  # ... but these
    x[1, BLOCK + 23] = -(2.0**e)  # in the second half of its block
    x[2, 2 * BLOCK :] = 0.0  # all-zero block: 2^-127
    cases.append((x, choice(g, list(ELEMENTS))))
    cases.append((x.clone(), "fp4_e2m1fn"))
    return cases


def _scale_ref(x, element):
    return qlab.quantize(x, ELEMENTS[element]).scales


register(
    Task(
        grade_id="mx_scale",
        func_name="mx_block_scales",
        points=2,
        assignment=ASSIGNMENT,
        cases=_scale_cases,
        reference=_scale_ref,
        compare=exact(),
        signature="mx_block_scales(x, element) -> float32 powers of two (R, K // 32)",
    )
)


def _mxfp4_cases(g: torch.Generator):
    cases = [(_blocks(g),) for _ in range(3)]
    x = weights(g, (2, 2 * BLOCK))
    x[0, 0] = 6.0 * 2.0 ** randint(g, -3, 3)  # amax exactly at the grid max
    x[1, BLOCK:] = 0.0
    cases.append((x,))
    return cases


def _mxfp4_ref(x):
    qt = qlab.quantize(x, "mxfp4")
    return qt.codes, qt.scales


register(
    Task(
        grade_id="mxfp4_quantize",
        func_name="mxfp4_quantize",
        points=3,
        assignment=ASSIGNMENT,
        cases=_mxfp4_cases,
        reference=_mxfp4_ref,
        compare=exact(names=("codes", "scales")),
        signature="mxfp4_quantize(x) -> (codes uint8 E2M1 (R, K), scales float32 (R, K // 32))",
    )
)


def _nvfp4_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        rows, k = randint(g, 1, 4), 16 * randint(g, 1, 6)
        cases.append((weights(g, (rows, k), outliers=bool(randint(g, 0, 1))),))
    x = weights(g, (3, 64))
    x[1, 16:32] = 0.0  # an all-zero block: its scale is floored at 2^-6, not 0/0
    x[2, 40] = 80.0  # an outlier: its block scale saturates the tensor scale's range
    cases.append((x,))
    return cases


def _nvfp4_ref(x):
    qt = qlab.quantize(x, "nvfp4")
    return qt.codes, qt.scales, qt.tensor_scale


register(
    Task(
        grade_id="nvfp4_quantize",
        func_name="nvfp4_quantize",
        points=3,
        assignment=ASSIGNMENT,
        cases=_nvfp4_cases,
        reference=_nvfp4_ref,
        compare=exact(names=("codes", "block_scales", "tensor_scale")),
        signature="nvfp4_quantize(x) -> (codes uint8 (R, K), block scales (R, K // 16), ts 0-d)",
    )
)
