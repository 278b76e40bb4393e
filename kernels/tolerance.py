"""How far a kernel's output may be from qlab's float32 reference, derived from its arithmetic.

Element by element, with magnitude = |x| @ |W_hat|.T (the sum of |products|):

  * fp32 accumulation: both sides add the same products in different orders, each product
    rounded at most once (the reference's x * w_hat can need 25 bits; the kernels'
    x * code is exact). A sum that rounds to nearest is within about K * 2**-24 of
    magnitude of the exact sum, so two are at most K * 2**-23 * magnitude apart: derived
    for the CPU interpreter. NVIDIA does not document the tensor cores' rounding: Fasi
    et al. (PeerJ CS 2021) probed V100, T4 and A100, Valpey et al. (arXiv 2502.15999)
    dispute the round-to-zero accumulation reported before them, and Khattak and Mikaitis
    (arXiv 2512.07004) model the H100's MMAs. If they truncate, the worst case is
    1.5 * K * 2**-23; the bound keeps K * 2**-23. On an H200 (Triton 3.6, 2026-12-04)
    every output the kernel tests and the benchmark checked against these bounds passed,
    but as pass or fail, with no error-to-bound ratio recorded: that does not tell the two
    apart;
  * W4A16 GEMM only: every weight c * s is rounded to the 16-bit dtype before the tensor
    cores see it: one ulp (2**-10 |w| in fp16, 2**-7 in bf16; one, not half, because the
    CPU interpreter truncates fp32 -> bf16), plus fp16's subnormal spacing 2**-24 per
    weight (c * s below 2**-14) times sum |x|;
  * FP8 on a GPU: Hopper's FP8 MMA keeps about 14 bits in its running sum (DeepSeek-V3
    technical report, sec. 3.3.2): each wgmma (32 products along K) may add two roundings
    of 2**-13 of magnitude (its products' sum, then its accumulator). With fast_accum=False
    the kernel promotes into a true fp32 sum every BLOCK_K (4 wgmmas), else never;
  * the output is rounded to x's dtype: one ulp of |y|, plus fp16's smallest subnormal.

A wrong nibble order, sign extension, group index or scale misses these by orders of
magnitude (tests/kernels show each bound catching such a bug).
"""

from __future__ import annotations

import math

import torch

__all__ = ["ULP", "FP8_MMA_ROUNDING", "w4a16_bound", "fp8_bound", "first_violation"]

ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # relative, one unit in the last place
FP16_SUBNORMAL = 2.0**-24  # spacing of fp16 below 2**-14, and its smallest subnormal
FP8_MMA_ROUNDING = 2.0**-13  # one rounding in a ~14-bit FP8 MMA accumulator (relative)
WGMMA_FP8_K = 32  # products along K per FP8 wgmma instruction


def w4a16_bound(x, w_hat, ref, weights_rounded: bool) -> torch.Tensor:
    """Allowed |y - ref| for y = w4a16_linear(x, packed): x (M, K) fp16/bf16, w_hat (N, K)
    float32 = qlab.dequantize(...), ref (M, N) float32. weights_rounded: the tensor-core
    GEMM (M > 1) rounds each weight to x's dtype; the GEMV (M = 1) keeps it exact."""
    xf = x.float().abs()
    magnitude = xf @ w_hat.abs().T
    k = x.shape[-1]
    rel = k * 2.0**-23 + (ULP[x.dtype] if weights_rounded else 0.0)
    bound = rel * magnitude + ULP[x.dtype] * ref.abs() + FP16_SUBNORMAL
    if weights_rounded and x.dtype == torch.float16:
        bound = bound + FP16_SUBNORMAL * xf.sum(-1, keepdim=True)
    return bound


def fp8_bound(
    qx_hat, qw_hat, ref, out_dtype, mma: bool, fast_accum: bool = False, block_k: int = 128
) -> torch.Tensor:
    """Allowed |y - ref| for y = fp8_linear(...): qx_hat (M, K) and qw_hat (N, K) the
    dequantized E4M3 operands (float32), ref (M, N) float32. mma: ran on a GPU's FP8
    tensor cores (reduced-precision accumulation) rather than the CPU interpreter."""
    magnitude = qx_hat.abs() @ qw_hat.abs().T
    k = qx_hat.shape[-1]
    rel = k * 2.0**-23
    if mma:
        per_sum = math.ceil(k / WGMMA_FP8_K) if fast_accum else block_k // WGMMA_FP8_K
        rel += 2 * per_sum * FP8_MMA_ROUNDING
    return rel * magnitude + ULP[out_dtype] * ref.abs() + FP16_SUBNORMAL


def first_violation(y, ref, bound) -> str | None:
    """None when |y - ref| <= bound everywhere, else a message about the worst element.
    Computed on y's device (a GPU run checks big outputs without copying them back)."""
    y = y.float()
    ref, bound = ref.to(y.device), bound.to(y.device)
    err = (y - ref).abs()
    if bool((err <= bound).all()):
        return None
    worst = int(torch.argmax(err - bound))
    return (
        f"element {worst}: got {y.flatten()[worst].item()}, expected "
        f"{ref.flatten()[worst].item()} (bound {bound.flatten()[worst].item():.3g}); "
        f"{int((err > bound).sum())} of {err.numel()} elements outside"
    )
