"""Chapter 06 (WxAy): pack/unpack int4, the W8A8 and W4A16 reference steps."""

from __future__ import annotations

import torch

import qlab
import qlab.pipelines
from qlab.grading.registry import Task, close, exact, register
from qlab.grading.tasks._inputs import choice, randint, weights

ASSIGNMENT = "06_wxay"


def _pack_cases(g: torch.Generator):
    cases = []
    for signed in (True, False, True):
        lo, hi = (-8, 7) if signed else (0, 15)
        shape = (randint(g, 1, 5), 2 * randint(g, 1, 24))
        cases.append((torch.randint(lo, hi + 1, shape, generator=g).to(torch.int8),))
    # every pair of nibbles once
    a = torch.arange(16).repeat_interleave(16)
    b = torch.arange(16).repeat(16)
    cases.append((torch.stack([a, b], -1).reshape(1, -1).to(torch.uint8),))
    return cases


register(
    Task(
        grade_id="pack_int4",
        func_name="pack_int4",
        points=2,
        assignment=ASSIGNMENT,
        cases=_pack_cases,
        reference=lambda codes: qlab.pack_int4(codes),
        compare=exact(),
        signature="pack_int4(codes) -> packed uint8 (..., K // 2)",
    )
)


def _unpack_cases(g: torch.Generator):
    cases = []
    for signed in (True, False, choice(g, (True, False))):
        shape = (randint(g, 1, 5), randint(g, 1, 24))
        cases.append((torch.randint(0, 256, shape, generator=g).to(torch.uint8), signed))
    cases.append((torch.arange(256).to(torch.uint8).reshape(4, 64), True))
    return cases


register(
    Task(
        grade_id="unpack_int4",
        func_name="unpack_int4",
        points=2,
        assignment=ASSIGNMENT,
        cases=_unpack_cases,
        reference=lambda packed, signed: qlab.unpack_int4(packed, signed=signed),
        compare=exact(),
        signature="unpack_int4(packed, signed) -> codes int8 (..., 2 * K)",
    )
)


def _w8a8_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        m, n, k = randint(g, 1, 6), randint(g, 1, 6), choice(g, (16, 32, 64))
        x = weights(g, (m, k), outliers=True)
        w = weights(g, (n, k))
        cases.append((x, w))
    x = weights(g, (4, 32))
    x[2] *= 50.0  # one loud token: a per-tensor activation scale would crush the others
    cases.append((x, weights(g, (3, 32))))
    return cases


register(
    Task(
        grade_id="w8a8_matmul",
        func_name="w8a8_matmul",
        points=3,
        assignment=ASSIGNMENT,
        cases=_w8a8_cases,
        reference=lambda x, w: qlab.pipelines.w8a8_reference(x, w, "int8", "channel", "token"),
        # the int8 products and their sums are exact; only the final rescale may round
        # differently ((acc * s_x) * s_w vs acc * (s_x * s_w)): a few float32 ulps
        compare=close(rtol=1e-6),
        signature="w8a8_matmul(x (M, K), w (N, K)) -> float32 (M, N)",
    )
)
