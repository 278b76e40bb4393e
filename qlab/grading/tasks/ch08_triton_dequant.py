"""Chapter 08 (Triton primer): unpack int4 and dequantize with group scales, in Triton.

The learner writes kernel bodies; the wrappers (given) move inputs to the kernel device
and return CPU tensors. Cases are small and ragged: kernels run on the Triton CPU
interpreter when grading (kernel_env), and masks must cover the tails.
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Task, exact, register
from qlab.grading.tasks._inputs import choice, randint, weights

ASSIGNMENT = "08_triton_dequant"
INTERPRETER = {"TRITON_INTERPRET": "1"}


def int4_qtensor(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> qlab.QTensor:
    """The QTensor whose codes qlab.pack_int4 packed into `packed` (shared by ch08/ch09)."""
    return qlab.QTensor(
        codes=qlab.unpack_int4(packed, signed=True),
        scales=scales,
        zero_points=None,
        scheme=qlab.get_scheme("int4"),
        granularity=group_size,
    )


def _unpack_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        rows, k_bytes = randint(g, 1, 21), randint(g, 1, 150)  # ragged in both directions
        cases.append((torch.randint(0, 256, (rows, k_bytes), generator=g).to(torch.uint8),))
    cases.append((torch.arange(256).to(torch.uint8).reshape(2, 128),))  # every byte once
    return cases


register(
    Task(
        grade_id="triton_unpack_int4",
        func_name="unpack_int4_triton",
        points=2,
        assignment=ASSIGNMENT,
        cases=_unpack_cases,
        reference=lambda packed: qlab.unpack_int4(packed, signed=True),
        compare=exact(),
        signature="unpack_int4_triton(packed uint8 (R, B)) -> int8 codes (R, 2 * B)",
        kernel_env=INTERPRETER,
    )
)


def _dequant_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        group = choice(g, (16, 32, 64, 128))
        rows, k = randint(g, 1, 37), group * randint(g, 1, 3)
        qt = qlab.quantize(weights(g, (rows, k), outliers=True), "int4", group)
        cases.append((qlab.pack_int4(qt.codes), qt.scales, group))
    # every nibble, -8 included (qlab's int4 uses -7..7; the layout allows -8)
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # shape: (3, 64)
    scales = (torch.rand(3, 2, generator=g) * 2 - 1).to(torch.float16)
    cases.append((qlab.pack_int4(codes), scales, 32))
    return cases


register(
    Task(
        grade_id="triton_dequant",
        func_name="dequant_int4",
        points=3,
        assignment=ASSIGNMENT,
        cases=_dequant_cases,
        # code * fp16 scale is exact in float32: the kernel must match bit for bit
        reference=lambda packed, scales, group: qlab.dequantize(
            int4_qtensor(packed, scales, group)
        ),
        compare=exact(),
        signature="dequant_int4(packed uint8 (R, K/2), scales fp16 (R, K/g), g) -> fp32 (R, K)",
        kernel_env=INTERPRETER,
    )
)
