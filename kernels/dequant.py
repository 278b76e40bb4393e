"""The primer kernel: dequantize packed int4 codes with group scales.

Reference (qlab): for a weight row r and column k,

    code[r, k]  = signed nibble of packed[r, k // 2]   (qlab.pack_int4 order:
                  even k in the LOW nibble, odd k in the HIGH nibble, two's complement)
    w_hat[r, k] = float32(code[r, k]) * float32(scales[r, k // group_size])

Pseudo-code of one Triton program (a BLOCK_R x BLOCK_K tile of the output):

    rows, cols = the tile's row and column indices
    byte   = load packed[rows, cols // 2]             # each byte is read for 2 columns
    nibble = (byte >> 4 * (cols % 2)) & 0xF           # low nibble for even cols
    code   = nibble - 16 if nibble >= 8 else nibble   # sign-extend 4-bit two's complement
    scale  = load scales[rows, cols // group_size]
    store out[rows, cols] = code * scale              # one fp32 multiply: bit-exact

The product of a 4-bit integer and an fp16 scale is exact in float32, so the kernel
and qlab.dequantize agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qlab.kernels._backend import check_device, needs_int64
from qlab.kernels.configs import Launch

__all__ = ["dequantize_int4"]

TILE_R, TILE_K = 16, 128  # default output tile of one program (BLOCK_R x BLOCK_K)


@triton.jit
def _dequant_int4_kernel(
    # pointers
    packed_ptr,  # uint8 (R, K // 2): qlab.pack_int4(codes)
    scales_ptr,  # fp16/fp32 (R, K // GROUP_SIZE)
    out_ptr,  # fp32 (R, K), or fp16/bf16 (the rounding of the exact fp32 value)
    # sizes
    R,
    K,
    # strides (elements; the last axis of every tensor is contiguous)
    stride_pr,
    stride_sr,
    stride_or,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INDEX_64: tl.constexpr,  # an element offset can pass 2**31 - 1: row offsets in int64
):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # shape: (BLOCK_R,)
    if INDEX_64:
        rows = rows.to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)  # shape: (BLOCK_K,)
    # The last tile may hang over the edge of the tensor: mask those lanes off.
    mask = (rows[:, None] < R) & (cols[None, :] < K)  # shape: (BLOCK_R, BLOCK_K)

    # Two columns share a byte; uint8 -> int32 zero-extends, so shifts are safe.
    byte = tl.load(packed_ptr + rows[:, None] * stride_pr + cols[None, :] // 2, mask=mask, other=0)
    byte = byte.to(tl.int32)
    nibble = (byte >> ((cols[None, :] % 2) * 4)) & 0xF  # even column: low nibble
    code = tl.where(nibble >= 8, nibble - 16, nibble)  # two's complement: 0xF -> -1

    # One scale per group of GROUP_SIZE columns of a row.
    scale = tl.load(
        scales_ptr + rows[:, None] * stride_sr + cols[None, :] // GROUP_SIZE, mask=mask, other=0.0
    )
    w_hat = code.to(tl.float32) * scale.to(tl.float32)  # exact in fp32
    out = w_hat.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], out, mask=mask)


def dequantize_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    *,
    out_dtype: torch.dtype = torch.float32,
    block_r: int = TILE_R,
    block_k: int = TILE_K,
) -> torch.Tensor:
    """Unpack and scale int4 codes: float32 (..., K), bit-exact with qlab.dequantize.

    packed: uint8 (..., K // 2) from qlab.pack_int4(qt.codes) of qlab.quantize(w, "int4", g)
    scales: float16/float32 (..., K // group_size), i.e. qt.scales
    out_dtype: float32 (exact for fp16 scales; with fp32 scales rounded once, as
    qlab.dequantize does: bit-exact either way), or float16/bfloat16 (the fp32 value
    rounded once; what a dequantize-then-matmul pipeline feeds the 16-bit matmul)
    """
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(
            f"packed must be a uint8 torch tensor from qlab.pack_int4, got "
            f"{getattr(packed, 'dtype', type(packed).__name__)}"
        )
    if not isinstance(scales, torch.Tensor) or scales.dtype not in (torch.float16, torch.float32):
        raise TypeError(
            f"scales must be a float16 or float32 torch tensor (qt.scales), got "
            f"{getattr(scales, 'dtype', type(scales).__name__)}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension (..., K // 2)")
    K = packed.shape[-1] * 2
    if K % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide the last dimension ({K}); "
            "pad the tensor or pick a divisor"
        )
    expected = (*packed.shape[:-1], K // group_size)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}, expected {expected} for packed "
            f"{tuple(packed.shape)} (K = {K}) and group_size {group_size}"
        )
    if not (packed.is_contiguous() and scales.is_contiguous()):
        raise ValueError("packed and scales must be contiguous; call .contiguous() first")
    check_device(packed, scales)

    packed_2d = packed.reshape(-1, K // 2)  # shape: (R, K // 2)
    scales_2d = scales.reshape(-1, K // group_size)  # shape: (R, K // group_size)
    R = packed_2d.shape[0]
    out = torch.empty((R, K), dtype=out_dtype, device=packed.device)
    if out.numel() == 0:
        return out.reshape(*packed.shape[:-1], K)
    plan(packed_2d, scales_2d, out, group_size, block_r, block_k)()
    return out.reshape(*packed.shape[:-1], K)


def plan(packed_2d, scales_2d, out, group_size: int, block_r: int = TILE_R,
         block_k: int = TILE_K) -> Launch:  # fmt: skip
    """The launch dequantize_int4 makes (also what qlab.kernels.compile_for builds)."""
    R, K = out.shape
    return Launch(
        kernel=_dequant_int4_kernel,
        grid=(triton.cdiv(R, block_r), triton.cdiv(K, block_k)),
        args=(packed_2d, scales_2d, out, R, K,
              packed_2d.stride(0), scales_2d.stride(0), out.stride(0)),  # fmt: skip
        meta=dict(GROUP_SIZE=group_size, BLOCK_R=block_r, BLOCK_K=block_k,
                  INDEX_64=needs_int64(packed_2d, scales_2d, out)),
    )
