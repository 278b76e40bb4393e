"""W8A8 FP8 (E4M3): fp8 weights, activations quantized on the fly, fp8 tensor-core dot.

Both operands cross the bus in 8 bits and the tensor cores multiply fp8 directly
(twice the bf16 rate on Hopper), so prefill and large batches gain in bandwidth AND
arithmetic. Scales (qlab's absmax rule, s = amax / 448, a true fp32 division):

    weight      s_w per output channel (N,) or per tensor: pack_fp8, via qlab.quantize
    activation  s_x per token (row of x, M values) or per tensor, computed at run time

Pseudo-code:

    # 1. activations, one program per row:  s_x[m] = max_k |x[m, k]| / 448
    # 2. activations, one program per tile: q_x[m, k] = e4m3(x[m, k] / s_x[m])   (RNE, saturating)
    # 3. GEMM, one program per BLOCK_M x BLOCK_N tile:
    acc = zeros(BLOCK_M, BLOCK_N, fp32)
    for k0 in range(0, K, BLOCK_K):
        acc = dot(q_x[m, k0:k0+BLOCK_K], q_w[n, k0:k0+BLOCK_K].T, acc)   # fp8 x fp8 -> fp32
    y[m, n] = acc * (s_x[m] * s_w[n])               # rescale ONCE, at the end

The rescale can wait until the end because every term of the sum over k shares the
same s_x[m] * s_w[n]; this is why per-token and per-channel scales are free in the
epilogue while per-group scales along K would not be.

Rounding to E4M3 (step 2) is done with exact fp32 arithmetic (round_to_e4m3) and the
final cast only converts a value that is already on the E4M3 grid. On a GPU the cast
alone would round correctly (cvt.rn.satfinite), but Triton's CPU interpreter does not
round to nearest even nor saturate when it casts, and the codes must match qlab bit
for bit on both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

import qlab
from qlab.kernels._backend import (
    INTERPRET,
    check_activation,
    check_device,
    check_linear_weight,
)

__all__ = [
    "FP8Weight",
    "pack_fp8",
    "quantize_act_fp8",
    "fp8_linear",
    "fp8_scaled_mm",
    "round_to_e4m3",
]

F8E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
# Globals a kernel reads must be tl.constexpr:
E4M3_MAX = tl.constexpr(F8E4M3_MAX)
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 RNE


class FP8Weight(NamedTuple):
    """An FP8 E4M3 weight (what pack_fp8 returns)."""

    codes: torch.Tensor  # float8_e4m3fn (N, K): the E4M3 bit patterns of qlab's codes
    scales: torch.Tensor  # float32 (N,) per channel, or (1,) per tensor
    granularity: str  # "channel" | "tensor"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4


@triton.jit
def round_to_e4m3(y):
    """fp32 -> the nearest E4M3 value (ties to even, saturating at +-448), still in fp32."""
    a = tl.minimum(tl.abs(y), E4M3_MAX)  # saturate (qlab's default, like the OCP spec)
    # Biased fp32 exponent of a; below 2**-6 (E4M3 subnormals) the spacing stays 2**-9.
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    # E4M3 has 3 mantissa bits: in binade 2**(e-127) the spacing (quantum) is 2**(e-127-3).
    quantum = ((e - 3) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((257 - e) << 23).to(tl.float32, bitcast=True)  # 2**(130 - e), exact
    steps = (a * inv_quantum + ROUND_MAGIC) - ROUND_MAGIC  # a / quantum < 16, rounded RNE
    v = steps * quantum  # exact: back on the E4M3 grid
    negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit, so -0.0 stays -0.0
    return tl.where(negative, -v, v)


@triton.jit
def _row_scale_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 (M, K)
    scale_ptr,  # fp32 (M,)
    # sizes
    K,
    # strides
    stride_xm,
    # meta-parameters
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # s = amax / 448 as a correctly rounded fp32 division (qlab's absmax rule).
    scale = tl.div_rn(tl.max(amax, axis=0), E4M3_MAX)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _act_quant_fp8_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 (M, K)
    scale_ptr,  # fp32 (M,) per token, or (1,) per tensor with stride_s = 0
    q_ptr,  # fp8e4nv (M, K)
    # sizes
    M,
    K,
    # strides
    stride_xm,
    stride_s,
    stride_qm,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    s = tl.load(scale_ptr + offs_m * stride_s, mask=offs_m < M, other=1.0)
    s = tl.where(s == 0.0, 1.0, s)  # an all-zero row: divide by 1, codes of 0 (as qlab)
    y = tl.div_rn(x.to(tl.float32), s[:, None])  # true fp32 division, as qlab
    q = round_to_e4m3(y).to(q_ptr.dtype.element_ty)  # exact cast: y is on the grid
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], q, mask=mask)


@triton.jit
def _fp8_gemm_kernel(
    # pointers
    a_ptr,  # fp8e4nv (M, K): quantized activations
    b_ptr,  # fp8e4nv (N, K): quantized weight, nn.Linear layout
    sa_ptr,  # fp32 (M,) or (1,): activation scales
    sb_ptr,  # fp32 (N,) or (1,): weight scales
    out_ptr,  # fp16/bf16 (M, N)
    # sizes
    M,
    N,
    K,
    # strides (0 for a per-tensor scale)
    stride_am,
    stride_bn,
    stride_sa,
    stride_sb,
    stride_om,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K  # K need not be a multiple of BLOCK_K: zeros add nothing
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # shape: (BLOCK_M, BLOCK_K) fp8
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # shape: (BLOCK_K, BLOCK_N) fp8, a tile of W^T (K contiguous, as wgmma wants)
        acc = tl.dot(a, b, acc)  # fp8 x fp8 products, fp32 accumulator

    # Epilogue: the only place the scales appear.
    s_a = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=0.0)
    s_b = tl.load(sb_ptr + offs_n * stride_sb, mask=mask_n, other=0.0)
    out = acc * (s_a[:, None] * s_b[None, :])
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _check_fp8_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda" and not INTERPRET:
        major, minor = torch.cuda.get_device_capability(t.device)
        if (major, minor) < (8, 9):
            raise RuntimeError(
                f"FP8 tensor cores need compute capability 8.9+ (Ada, Hopper, Blackwell); "
                f"this GPU is sm_{major}{minor}. Use the W4A16 kernel or the interpreter."
            )


def pack_fp8(weight: torch.Tensor, granularity: str = "channel") -> FP8Weight:
    """Quantize an nn.Linear weight (N, K) to FP8 E4M3 with qlab.quantize(weight,
    "fp8_e4m3", granularity); granularity "channel" (one scale per output row) or "tensor".
    """
    check_linear_weight(weight)
    if granularity not in ("channel", "tensor"):
        raise ValueError(
            f"granularity must be 'channel' or 'tensor' for the FP8 kernel, got "
            f"{granularity!r} (per-group scales along K cannot be applied once at the end)"
        )
    qt = qlab.quantize(weight, "fp8_e4m3", granularity)  # codes uint8 (N, K), scales fp32
    codes = qt.codes.view(torch.float8_e4m3fn)  # same bits, a dtype tl.dot understands
    scales = qt.scales.reshape(-1).to(torch.float32)  # (N,) or (1,)
    return FP8Weight(
        codes=codes.contiguous().to(weight.device),
        scales=scales.contiguous().to(weight.device),
        granularity=granularity,
    )


def quantize_act_fp8(
    x: torch.Tensor, granularity: str = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations x (M, K) to E4M3 at run time, in two Triton kernels.

    Returns (codes float8_e4m3fn (M, K), scales float32: (M,) per token or () per tensor),
    bit-exact with qlab.quantize(x, "fp8_e4m3", "channel" | "tensor").
    """
    if granularity not in ("token", "tensor"):
        raise ValueError(f"act granularity must be 'token' or 'tensor', got {granularity!r}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ):
        raise TypeError(
            f"x must be a float16, bfloat16 or float32 tensor, got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call x.contiguous() first")
    check_device(x)
    M, K = x.shape
    codes = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    row_scales = torch.zeros((M,), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return codes, row_scales if granularity == "token" else row_scales.new_zeros(())
    _row_scale_kernel[(M,)](x, row_scales, K, x.stride(0), BLOCK_K=256)
    if granularity == "token":
        scales, stride_s = row_scales, 1
    else:
        # Division by 448 is monotonic, so max_m(amax_m / 448) == amax(x) / 448 exactly.
        scales, stride_s = row_scales.amax(), 0
    block_m, block_k = 16, 128
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    _act_quant_fp8_kernel[grid](
        x, scales, codes,
        M, K,
        x.stride(0), stride_s, codes.stride(0),
        BLOCK_M=block_m, BLOCK_K=block_k,
    )  # fmt: skip
    return codes, scales


def fp8_linear(x: torch.Tensor, w: FP8Weight, act_granularity: str = "token") -> torch.Tensor:
    """y = x @ W_hat.T with activations quantized to E4M3 on the fly (per token or
    per tensor), an fp8 tensor-core dot, fp32 accumulation and one rescale at the end.

    x: (..., K) float16 or bfloat16; returns (..., N) in x's dtype. Needs sm_89+ on a GPU.
    """
    if not isinstance(w, FP8Weight):
        raise TypeError(f"w must be the FP8Weight from pack_fp8, got {type(w).__name__}")
    if act_granularity not in ("token", "tensor"):
        raise ValueError(f"act_granularity must be 'token' or 'tensor', got {act_granularity!r}")
    N, K = w.shape
    check_activation(x, K)
    check_device(x, w.codes, w.scales)
    _check_fp8_device(x)

    x2 = x.reshape(-1, K)  # shape: (M, K)
    if x2.shape[0] == 0 or N == 0:
        return torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    q_x, s_x = quantize_act_fp8(x2, act_granularity)
    return fp8_scaled_mm(q_x, s_x, w, x.dtype).reshape(*x.shape[:-1], N)


def fp8_scaled_mm(
    q_x: torch.Tensor, s_x: torch.Tensor, w: FP8Weight, out_dtype: torch.dtype
) -> torch.Tensor:
    """The GEMM alone: (q_x (M, K) fp8, s_x (M,) or ()) from quantize_act_fp8, times
    W_hat.T -> (M, N) in out_dtype. What torch._scaled_mm does; fp8_linear calls it."""
    if q_x.dtype != torch.float8_e4m3fn or q_x.ndim != 2 or not q_x.is_contiguous():
        raise ValueError("q_x must be a contiguous 2-D float8_e4m3fn tensor (quantize_act_fp8)")
    M, K = q_x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"q_x has K = {K} but the weight has in_features {w.shape[1]}")
    if s_x.dtype != torch.float32 or tuple(s_x.shape) not in ((M,), ()):
        raise ValueError(f"s_x must be float32 of shape ({M},) or (), got {tuple(s_x.shape)}")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    check_device(q_x, s_x, w.codes)
    _check_fp8_device(q_x)
    out = torch.empty((M, N), dtype=out_dtype, device=q_x.device)
    if M == 0 or N == 0:
        return out
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    block_n = 64 if M <= 64 else 128
    block_k = 128
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _fp8_gemm_kernel[grid](
        q_x, w.codes, s_x, w.scales, out,
        M, N, K,
        q_x.stride(0), w.codes.stride(0),
        1 if s_x.ndim == 1 else 0,  # per token, or one scale broadcast with stride 0
        1 if w.granularity == "channel" else 0,
        out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4 if block_m <= 32 else 8, num_stages=3,
    )  # fmt: skip
    return out
