"""W4A16: int4 weights with group scales, 16-bit activations, fp32 accumulation.

Weight-only quantization (GPTQ, AWQ, most GGUF files): the packed 4-bit weights are
what crosses the memory bus; they are unpacked and scaled inside the kernel and the
matmul itself runs in 16 bit. That saves bandwidth (about 3.5x fewer weight bytes
than bf16 at group 128) and no arithmetic.

Layout (pack_w4a16): the nn.Linear weight W (N = out_features, K = in_features) is
quantized with qlab.quantize(W, "int4", group_size) and packed with qlab.pack_int4,
so packed[n, k // 2] holds code[n, k] (even k in the low nibble), scales[n, k // g].
Nothing is transposed: row n of `packed` is row n of W.

Pseudo-code of one GEMM program (a BLOCK_M x BLOCK_N tile of y = x @ W_hat.T):

    acc = zeros(BLOCK_M, BLOCK_N, fp32)
    for k0 in range(0, K, BLOCK_K):                   # BLOCK_K divides group_size, so
        x_tile = x[m, k0:k0+BLOCK_K]                  #   one K tile = one scale group
        codes  = unpack(packed[n, (k0:k0+BLOCK_K) // 2]).T     # (BLOCK_K, BLOCK_N) int
        s      = scales[n, k0 // group_size]                   # (BLOCK_N,)
        acc   += dot(x_tile, codes.to(x.dtype)) * s            # 16-bit dot, fp32 acc
    y[m, n] = acc.to(x.dtype)

The scale is factored out of each K tile: sum_k x[k] * (c[k] * s) = s * sum_k x[k] * c[k]
when every k of the tile shares the group scale s. The codes (-8..7) are exact in fp16
and bf16, so the tensor cores see exact weights; the alternative, scaling the weight
tile first (w_hat = c * s rounded to 16 bit), costs BLOCK_K x more multiplies and one
more rounding. The GEMV program (M = 1, the decode step) does the same with plain
multiply-and-sum instead of tl.dot: with one row of x there is no tile to feed the
tensor cores, and the kernel is bound by reading the weights anyway.
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

__all__ = ["W4A16Weight", "pack_w4a16", "w4a16_linear"]

MIN_DOT_K = 16  # tl.dot needs K tiles of at least 16


class W4A16Weight(NamedTuple):
    """A packed W4A16 weight (what pack_w4a16 returns)."""

    packed: torch.Tensor  # uint8 (N, K // 2): qlab.pack_int4(codes), even k in the low nibble
    scales: torch.Tensor  # float16 (N, K // group_size)
    group_size: int
    shape: tuple[int, int]  # (N, K) of the original weight

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight: packed codes + scales."""
        return self.packed.numel() * self.packed.element_size() + (
            self.scales.numel() * self.scales.element_size()
        )


@triton.jit
def _unpack_int4_tile(packed_ptr, offs_n, offs_k, stride_pn, mask_n):
    """Load the int4 codes of W[offs_n, offs_k] as an int32 (BLOCK_K, BLOCK_N) tile."""
    # W^T tile: k runs down the rows, n across the columns. Two k share one byte.
    byte = tl.load(
        packed_ptr + offs_n[None, :] * stride_pn + offs_k[:, None] // 2,
        mask=mask_n[None, :],
        other=0,
    ).to(tl.int32)  # zero-extend uint8
    nibble = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF  # even k: low nibble (qlab.pack_int4)
    return tl.where(nibble >= 8, nibble - 16, nibble)  # sign-extend 4-bit two's complement


@triton.jit
def _w4a16_gemm_kernel(
    # pointers
    x_ptr,  # fp16/bf16 (M, K)
    packed_ptr,  # uint8 (N, K // 2)
    scales_ptr,  # fp16 (N, K // GROUP_SIZE)
    out_ptr,  # x's dtype (M, N)
    # sizes
    M,
    N,
    K,
    # strides (the last axis of every tensor is contiguous)
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,  # a multiple of BLOCK_K: one scale per K tile
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16 (see wrapper)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # shape: (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # shape: (BLOCK_N,)
    mask_m = offs_m < M  # ragged M and N: masked loads read 0, masked stores skip
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the wrapper)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0
        )
        codes = _unpack_int4_tile(packed_ptr, offs_n, offs_k, stride_pn, mask_n)
        scale = tl.load(scales_ptr + offs_n * stride_sn + k0 // GROUP_SIZE, mask=mask_n, other=0.0)
        if UPCAST_DOT:
            part = tl.dot(x.to(tl.float32), codes.to(tl.float32))  # same exact products
        else:
            # 16-bit tensor-core dot, fp32 result; codes (-8..7) are exact in fp16/bf16.
            part = tl.dot(x, codes.to(x.dtype))
        acc += part * scale.to(tl.float32)[None, :]  # the tile's group scale, per column

    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        out,
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _w4a16_gemv_kernel(
    # pointers
    x_ptr,  # fp16/bf16 (K,)
    packed_ptr,  # uint8 (N, K // 2)
    scales_ptr,  # fp16 (N, K // GROUP_SIZE)
    out_ptr,  # x's dtype (N,)
    # sizes
    N,
    K,
    # strides
    stride_pn,
    stride_sn,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # shape: (BLOCK_N,)
    mask_n = offs_n < N

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k).to(tl.float32)  # shape: (BLOCK_K,)
        codes = _unpack_int4_tile(packed_ptr, offs_n, offs_k, stride_pn, mask_n)
        # x * code is exact in fp32 (16-bit x, 4-bit code); the sum rounds in fp32.
        part = tl.sum(codes.to(tl.float32) * x[:, None], axis=0)  # shape: (BLOCK_N,)
        scale = tl.load(scales_ptr + offs_n * stride_sn + k0 // GROUP_SIZE, mask=mask_n, other=0.0)
        acc += part * scale.to(tl.float32)

    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    return min(n & -n, cap)


def pack_w4a16(weight: torch.Tensor, group_size: int = 128) -> W4A16Weight:
    """Quantize an nn.Linear weight (N, K) to int4 with group scales and pack it.

    Uses qlab.quantize(weight, "int4", group_size) and qlab.pack_int4 (THE nibble order).
    group_size must divide K and be a multiple of 16 (the kernel's smallest K tile).
    """
    check_linear_weight(weight)
    N, K = weight.shape
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if group_size % MIN_DOT_K:
        raise ValueError(
            f"group_size {group_size} is not a multiple of {MIN_DOT_K}: the kernel reads one "
            "scale per K tile and tl.dot needs tiles of at least 16; use 32, 64 or 128"
        )
    if K % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide in_features K = {K}; "
            "pad the weight or pick a divisor"
        )
    qt = qlab.quantize(weight, "int4", group_size)  # codes int8 (N, K), scales fp16 (N, K//g)
    packed = qlab.pack_int4(qt.codes)  # shape: (N, K // 2) uint8
    return W4A16Weight(
        packed=packed.contiguous().to(weight.device),
        scales=qt.scales.contiguous().to(weight.device),
        group_size=group_size,
        shape=(N, K),
    )


def w4a16_linear(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """y = x @ W_hat.T for x (..., K) in fp16/bf16; returns (..., N) in x's dtype.

    W_hat = qlab.dequantize(qlab.quantize(W, "int4", group_size)); accumulation is fp32.
    M = 1 (one token) takes the GEMV kernel, larger M the tiled tensor-core GEMM.
    """
    if not isinstance(w, W4A16Weight):
        raise TypeError(f"w must be the W4A16Weight from pack_w4a16, got {type(w).__name__}")
    N, K = w.shape
    check_activation(x, K)
    check_device(x, w.packed, w.scales)

    x2 = x.reshape(-1, K)  # shape: (M, K)
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.reshape(*x.shape[:-1], N)
    g = w.group_size
    if M == 1:
        block_n, block_k = 32, _largest_pow2_divisor(g, 256)
        _w4a16_gemv_kernel[(triton.cdiv(N, block_n),)](
            x2, w.packed, w.scales, out,
            N, K,
            w.packed.stride(0), w.scales.stride(0),
            GROUP_SIZE=g, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4,
        )  # fmt: skip
    else:
        # Tile sizes by M: small batches waste less of a 16-row tile; large ones reuse more.
        block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
        block_n = 64 if M <= 64 else 128
        block_k = _largest_pow2_divisor(g, 64)
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _w4a16_gemm_kernel[grid](
            x2, w.packed, w.scales, out,
            M, N, K,
            x2.stride(0), w.packed.stride(0), w.scales.stride(0), out.stride(0),
            GROUP_SIZE=g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            # Triton's CPU interpreter feeds bf16 to numpy as raw uint16 in tl.dot;
            # upcasting to fp32 there gives the same exact products and fp32 sums.
            UPCAST_DOT=INTERPRET and x.dtype == torch.bfloat16,
            num_warps=4 if block_m <= 32 else 8, num_stages=3,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], N)
