"""Chapter 10 (FP8 kernel): per-token E4M3 activation quantization and the FP8 GEMM with
one rescale at the end, in Triton."""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Task, close, exact, register
from qlab.grading.tasks._inputs import randint, weights
from qlab.grading.tasks.ch08_triton_dequant import INTERPRETER

ASSIGNMENT = "10_fp8_kernel"
E4M3 = qlab.formats.get("fp8_e4m3fn")


def _act_cases(g: torch.Generator):
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        m, k = randint(g, 1, 20), randint(g, 1, 300)  # ragged K: masks on the row loop
        x = weights(g, (m, k), outliers=True)
        x = x * torch.logspace(-2, 2, m)[:, None]  # rows of very different ranges
        cases.append((x.to(dtype),))
    x = weights(g, (4, 64))
    x[1] = 0.0  # an all-zero token: scale 0, codes 0
    cases.append((x,))
    return cases


def _act_reference(x: torch.Tensor):
    qt = qlab.quantize(x, "fp8_e4m3", "channel")  # one scale per row (token)
    return qt.codes, qt.scales.reshape(-1)


register(
    Task(
        grade_id="fp8_act_quant",
        func_name="fp8_quantize_rows",
        points=3,
        assignment=ASSIGNMENT,
        cases=_act_cases,
        reference=_act_reference,
        compare=exact(names=("codes", "scales")),
        signature="fp8_quantize_rows(x (M, K)) -> (codes uint8 (M, K), scales fp32 (M,))",
        kernel_env=INTERPRETER,
    )
)


def _gemm_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        m, n, k = randint(g, 1, 40), randint(g, 1, 70), randint(g, 1, 300)
        qx = qlab.quantize(weights(g, (m, k), scale=1.0, outliers=True), "fp8_e4m3", "channel")
        qw = qlab.quantize(weights(g, (n, k), scale=0.05), "fp8_e4m3", "channel")
        cases.append((qx.codes, qx.scales.reshape(-1), qw.codes, qw.scales.reshape(-1)))
    return cases


def _gemm_reference(q_x, s_x, q_w, s_w):
    # qlab.pipelines.w8a8_reference, from the codes: exact fp32 products, fp32 sums,
    # one rescale at the end
    acc = E4M3.decode(q_x) @ E4M3.decode(q_w).T
    return acc * (s_x[:, None] * s_w[None, :])


register(
    Task(
        grade_id="fp8_gemm",
        func_name="fp8_matmul",
        points=3,
        assignment=ASSIGNMENT,
        cases=_gemm_cases,
        reference=_gemm_reference,
        # fp8 x fp8 products are exact in fp32; only the order of the fp32 sums and of the
        # two scale multiplications differ: <= K * 2**-23 of sum |terms| (~1e-5 here)
        compare=close(rtol=1e-4, atol=1e-4),
        signature="fp8_matmul(q_x u8 (M, K), s_x (M,), q_w u8 (N, K), s_w (N,)) -> fp32 (M, N)",
        kernel_env=INTERPRETER,
    )
)
