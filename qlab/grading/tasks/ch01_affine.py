"""Chapter 01 (affine quantization): symmetric, asymmetric, dequantize. Per tensor."""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Task, exact, register
from qlab.grading.tasks._inputs import choice, on_grid, randint, weights

ASSIGNMENT = "01_affine"


def _sym_cases(g: torch.Generator):
    cases = []
    for _ in range(3):  # random weights, random width
        bits = randint(g, 2, 8)
        cases.append(
            (
                weights(
                    g, (randint(g, 1, 4), choice(g, (8, 16, 24))), outliers=bool(randint(g, 0, 1))
                ),
                bits,
            )
        )
    # exact ties: a power-of-two scale, x on the half-steps -> round half to EVEN matters
    bits = randint(g, 3, 6)
    qmax = 2 ** (bits - 1) - 1
    step = 2.0 ** randint(g, -6, 1)
    x = on_grid(g, (4, 16), step, -qmax, qmax)
    x[randint(g, 0, 3), randint(g, 0, 15)] = qmax * step * choice(g, (1.0, -1.0))
    cases.append((x, bits))
    cases.append((torch.zeros(2, 8), randint(g, 2, 8)))  # all zeros: scale 0, codes 0
    return cases


def _sym_ref(x, bits):
    qt = qlab.quantize(x, qlab.int_scheme(bits))
    return qt.codes, qt.scales


register(
    Task(
        grade_id="sym_quantize",
        func_name="symmetric_quantize",
        points=2,
        assignment=ASSIGNMENT,
        cases=_sym_cases,
        reference=_sym_ref,
        compare=exact(names=("codes", "scale")),
        signature="symmetric_quantize(x, bits) -> (codes int8, scale float16 0-d)",
    )
)


def _asym_cases(g: torch.Generator):
    cases = []
    for sign in (0, 1, -1):  # mixed, all >= 0 (after ReLU), all <= 0
        bits = randint(g, 2, 8)
        x = weights(g, (randint(g, 1, 4), choice(g, (8, 16, 32))))
        if sign:
            x = sign * x.abs()
        x = x + (0.25 * float(x.abs().max()) if sign == 0 and randint(g, 0, 1) else 0.0)
        cases.append((x, bits))
    # exact ties: range [-(z) * s, (levels - 1 - z) * s] with a power-of-two scale
    bits = randint(g, 3, 8)
    levels = 2**bits - 1
    step = 2.0 ** randint(g, -5, 1)
    z = randint(g, 1, levels - 1)
    x = on_grid(g, (3, 16), step, -z, levels - z)
    x[0, 0], x[0, 1] = -z * step, (levels - z) * step
    cases.append((x, bits))
    cases.append((torch.zeros(1, 8), randint(g, 2, 8)))
    return cases


def _asym_ref(x, bits):
    qt = qlab.quantize(x, qlab.int_scheme(bits, symmetric=False))
    return qt.codes, qt.scales, qt.zero_points


register(
    Task(
        grade_id="asym_quantize",
        func_name="asymmetric_quantize",
        points=2,
        assignment=ASSIGNMENT,
        cases=_asym_cases,
        reference=_asym_ref,
        compare=exact(names=("codes", "scale", "zero_point")),
        signature="asymmetric_quantize(x, bits) -> (codes uint8, scale float16, zero_point uint8)",
    )
)


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


register(
    Task(
        grade_id="affine_dequantize",
        func_name="affine_dequantize",
        points=1,
        assignment=ASSIGNMENT,
        cases=_deq_cases,
        reference=_deq_ref,
        compare=exact(),
        signature="affine_dequantize(codes, scale, zero_point) -> float32 x_hat",
    )
)
