"""Chapter 03 (NF4): levels from normal quantiles; blockwise absmax NF4 quantization."""

from __future__ import annotations

import torch

import qlab
from qlab.formats import quantile_levels
from qlab.grading.registry import Task, close, exact, register
from qlab.grading.tasks._inputs import randint, weights

ASSIGNMENT = "03_nf4"


def _levels_cases(g: torch.Generator):
    # a fresh offset each time (QLoRA uses 0.9677083), so a pasted table cannot pass
    offsets = torch.empty(3).uniform_(0.93, 0.995, generator=g)
    return [(float(o),) for o in offsets] + [(0.9677083,)]


register(
    Task(
        grade_id="nf4_levels",
        func_name="nf4_levels",
        points=2,
        assignment=ASSIGNMENT,
        cases=_levels_cases,
        reference=lambda offset: quantile_levels(offset),
        # 1e-6: different implementations of the normal quantile function (torch.special.ndtri,
        # statistics.NormalDist, scipy) agree to ~1e-15 in float64 but a float32 level may
        # still land one ulp (6e-8) apart; 1e-6 is far below the 0.08 gap between levels.
        compare=close(rtol=0.0, atol=1e-6),
        signature="nf4_levels(offset) -> 16 float32 levels, ascending, in [-1, 1]",
    )
)


def _nf4_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        rows, k = randint(g, 1, 4), 64 * randint(g, 1, 3)
        w = weights(g, (rows, k), outliers=bool(randint(g, 0, 1)))
        if k > 64 and randint(g, 0, 1):
            w[0, 64:128] = 0.0  # an all-zero block
        cases.append((w,))
    # values exactly on the fp32 midpoints (absmax 1): bitsandbytes takes the LOWER code
    mids = qlab.formats.get("nf4").midpoints
    w = mids[torch.randint(0, 15, (2, 64), generator=g)].clone()
    w[:, 0] = 1.0
    cases.append((w,))
    return cases


def _nf4_ref(w):
    qt = qlab.quantize(w, "nf4")
    return qt.codes, qt.scales


register(
    Task(
        grade_id="nf4_quantize",
        func_name="nf4_quantize",
        points=3,
        assignment=ASSIGNMENT,
        cases=_nf4_cases,
        reference=_nf4_ref,
        compare=exact(names=("codes", "absmax")),
        signature="nf4_quantize(w) -> (codes uint8 (R, K), absmax float32 (R, K // 64))",
    )
)
