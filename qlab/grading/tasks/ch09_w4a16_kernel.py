"""Chapter 09 (W4A16 kernel): a GEMV for one token and a tiled GEMM, in Triton.

Inputs are packed exactly as qlab.kernels.pack_w4a16 packs them (qlab.pack_int4 codes,
fp16 group scales); the reference dequantizes with qlab and multiplies in float32.
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Task, close, register
from qlab.grading.tasks._inputs import choice, randint, weights
from qlab.grading.tasks.ch08_triton_dequant import INTERPRETER, int4_qtensor

ASSIGNMENT = "09_w4a16_kernel"

# Tolerance: every product is exact in fp32 and the kernel sums the same terms in another
# order (<= K * 2**-24 * sum |x| |w_hat| ~ 1e-6 here); a kernel that rounds c * s to fp16
# before the dot adds up to 2**-11 of each term (~5e-4 RMS for these inputs). A wrong
# nibble order, scale or group index errs by 1e-2 to 1e0.
TOL = close(rtol=1e-3, atol=2e-3)


def _packed_weight(g: torch.Generator, n: int, k: int, group: int):
    qt = qlab.quantize(weights(g, (n, k), scale=0.05), "int4", group)
    return qlab.pack_int4(qt.codes), qt.scales


def _reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int):
    w_hat = qlab.dequantize(int4_qtensor(packed, scales, group))  # (N, K) float32
    return x.float() @ w_hat.T


def _gemv_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        group = choice(g, (32, 64, 128))
        n, k = randint(g, 1, 70), group * randint(g, 2, 4)  # >= 2 groups along K
        x = torch.randn(k, generator=g).to(torch.float16)
        cases.append((x, *_packed_weight(g, n, k, group), group))
    return cases


register(
    Task(
        grade_id="w4a16_gemv",
        func_name="w4a16_gemv",
        points=3,
        assignment=ASSIGNMENT,
        cases=_gemv_cases,
        reference=_reference,
        compare=TOL,
        signature="w4a16_gemv(x fp16 (K,), packed (N, K/2), scales (N, K/g), g) -> fp32 (N,)",
        kernel_env=INTERPRETER,
    )
)


def _gemm_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        group = choice(g, (32, 64))
        m, n, k = randint(g, 2, 40), randint(g, 1, 70), group * randint(g, 2, 4)
        x = torch.randn(m, k, generator=g).to(torch.float16)
        cases.append((x, *_packed_weight(g, n, k, group), group))
    return cases


register(
    Task(
        grade_id="w4a16_gemm",
        func_name="w4a16_gemm",
        points=3,
        assignment=ASSIGNMENT,
        cases=_gemm_cases,
        reference=_reference,
        compare=TOL,
        signature="w4a16_gemm(x fp16 (M, K), packed (N, K/2), scales (N, K/g), g) -> fp32 (M, N)",
        kernel_env=INTERPRETER,
    )
)
