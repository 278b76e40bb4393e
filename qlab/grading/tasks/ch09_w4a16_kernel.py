"""Chapter 09 (W4A16 kernel): a GEMV for one token and a tiled GEMM, in Triton.

Inputs are packed exactly as qlab.kernels.pack_w4a16 packs them (qlab.pack_int4 codes,
fp16 group scales); the reference dequantizes with qlab and multiplies in float32.
Loads and stores are bounds-checked on the interpreter (tasks/_bounds.py).

Spec clauses and the fixed case (every seed) that breaking each one changes:

w4a16_gemv(x (K,), packed (N, K/2), scales (N, K/g), g) -> fp32 (N,)   [BLOCK_K = min(g, 128)]
w4a16_gemm(x (M, K), ...) -> fp32 (M, N)                                [BLOCK_K = min(g, 64)]
  W1 the K tile at k0 uses scale column k0 // g, not k0 // BLOCK_K
     (g = 256 for the GEMV, g = 128 and 256 for the GEMM: BLOCK_K < g)  "big groups"
  W2 every group's own scale (groups scaled 10x apart) ............... "big groups"
  W3 nibble order and sign extension ................................. every case
  W4 rows of the weight (N) and of x (M) masked in loads and stores ... odd N, M every case
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Mismatch, close, tasks_for
from qlab.grading.tasks._inputs import INTERPRETER, choice, int4_qtensor, packed_int4, randint
from qlab.grading.tasks._spec import num

task = tasks_for("09_w4a16_kernel", kernel_env=INTERPRETER)


def _reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int):
    w_hat = qlab.dequantize(int4_qtensor(packed, scales, group))  # (N, K) float32
    return x.float() @ w_hat.T


def _explain(args, m: Mismatch) -> str:
    """Per-group partial sums of the expected output (no input has the output's layout)."""
    x, packed, scales, group = args
    *row, n = m.index
    codes = qlab.unpack_int4(packed[n : n + 1], signed=True)[0].float()  # (K,)
    xs = x[row[0]] if row else x
    parts = (codes * xs.float()).reshape(-1, group).sum(-1) * scales[n].float()
    shown = ", ".join(num(p) for p in parts[:8]) + (", ..." if parts.numel() > 8 else "")
    return (
        f"output {list(m.index)} = sum over the {parts.numel()} groups of "
        f"scales[{n}, j] * (codes[{n}, group j] . x{row or ''}[group j]); those terms are "
        f"[{shown}] with scales[{n}] = [{', '.join(num(s) for s in scales[n][:8])}"
        f"{', ...' if scales.shape[1] > 8 else ''}] (group size {group})"
    )


# Tolerance: the kernel sums the same terms (each product rounded at most once) in another
# order (<= K * 2**-24 * sum |x| |w_hat| ~ 1e-6 here); a kernel that rounds c * s to fp16
# before the dot adds up to 2**-11 of each term (~5e-4 RMS for these inputs). A wrong
# nibble order, scale or group index errs by 1e-2 to 1e0.
TOL = close(rtol=1e-3, atol=2e-3, explain=_explain)


def _weights(g: torch.Generator, n: int, k: int, group: int):
    """Packed int4 weights whose group scales differ by up to 10x along K."""
    w = torch.randn(n, k, generator=g) * 0.05
    w *= torch.logspace(-0.5, 0.5, k // group)[
        torch.randperm(k // group, generator=g)
    ].repeat_interleave(group)
    return packed_int4(w, group)


@task("w4a16_gemv", "w4a16_gemv", points=3, reference=_reference, compare=TOL,
      implements=("qlab.dequantize", "qlab.kernels.dequantize_int4", "qlab.kernels.w4a16_linear"),
      signature="w4a16_gemv(x fp16 (K,), packed (N, K/2), scales (N, K/g), g) -> fp32 (N,)")
def _gemv_cases(g: torch.Generator):
    cases = []
    for group in (choice(g, (32, 64, 128)), 128, 256):  # 256: two K tiles per group
        n, k = 2 * randint(g, 16, 35) + 1, group * randint(g, 2, 3)  # N odd: a partial tile
        x = torch.randn(k, generator=g).to(torch.float16)
        cases.append((x, *_weights(g, n, k, group), group))
    return cases


@task("w4a16_gemm", "w4a16_gemm", points=3, reference=_reference, compare=TOL,
      implements=("qlab.dequantize", "qlab.kernels.dequantize_int4", "qlab.kernels.w4a16_linear"),
      signature="w4a16_gemm(x fp16 (M, K), packed (N, K/2), scales (N, K/g), g) -> fp32 (M, N)")
def _gemm_cases(g: torch.Generator):
    cases = []
    for group in (choice(g, (32, 64)), 128, 256):  # 128, 256: several K tiles per group
        m, n, k = 2 * randint(g, 8, 20) + 1, 2 * randint(g, 16, 35) + 1, group * 2  # odd M, N
        x = torch.randn(m, k, generator=g).to(torch.float16)
        cases.append((x, *_weights(g, n, k, group), group))
    return cases
