"""Two 4-bit codes per byte: THE nibble order of qlab, used everywhere (kernels included).

Layout, along the last axis (the reduction axis K of a weight):

    byte[..., j] = (code[..., 2*j] & 0xF)  |  (code[..., 2*j + 1] & 0xF) << 4

The element with the even index goes in the LOW nibble, the odd one in the HIGH
nibble (the order of GPTQ/AWQ-style and torchao uint4 packing along K).
Signed codes (int4, -8..7) are stored as 4-bit two's complement; unsigned codes
(FP4 E2M1 codes, NF4 indices, asymmetric uint4) as they are.
"""

from __future__ import annotations

import torch

__all__ = ["pack_int4", "unpack_int4"]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack integer codes in [-8, 15] two per byte along the last axis.

    codes: integer tensor of shape (..., K) with K even.
    Returns uint8 of shape (..., K // 2).
    """
    codes = torch.as_tensor(codes)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"pack_int4 takes integer codes, got {codes.dtype}; quantize first")
    if codes.ndim == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(
            f"pack_int4 needs an even last dimension, got shape {tuple(codes.shape)}; "
            "pad the reduction axis to a multiple of 2"
        )
    c = codes.to(torch.int16)
    if c.numel() and (int(c.min()) < -8 or int(c.max()) > 15):
        raise ValueError("codes must lie in [-8, 15] (int4 or uint4) to fit in a nibble")
    c = (c & 0xF).to(torch.uint8)
    # shape: (..., K // 2, 2): [even, odd] pairs
    pairs = c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """Inverse of pack_int4: uint8 (..., K // 2) -> int8 codes (..., K).

    signed=True sign-extends each nibble (-8..7); signed=False gives 0..15.
    """
    packed = torch.as_tensor(packed)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 takes uint8 bytes, got {packed.dtype}")
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    # shape: (..., K // 2, 2) -> (..., K)
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    if signed:
        codes = torch.where(codes >= 8, codes - 16, codes)
    return codes
