"""Two 4-bit codes per byte: THE nibble order of qlab, used everywhere (kernels included).

Layout, along the last axis (the reduction axis K of a weight):

    byte[..., j] = (code[..., 2*j] & 0xF)  |  (code[..., 2*j + 1] & 0xF) << 4

The element with the even index goes in the LOW nibble, the odd one in the HIGH
nibble (the order of GPTQ/AWQ-style and torchao uint4 packing along K).
Signed codes (int4, -8..7) are stored as 4-bit two's complement; unsigned codes
(FP4 E2M1 codes, NF4 indices, asymmetric uint4) as they are.

A nibble does not remember whether it was signed: 0b1001 is 9 unsigned and -7 signed.
So pack_int4 only accepts codes that unpack_int4 gives back unchanged: -8..7 when
signed, 0..15 when unsigned (a signed 9 would silently come back as -7).
"""

from __future__ import annotations

import torch

__all__ = ["pack_int4", "unpack_int4"]

SIGNED_RANGE = (-8, 7)  # int4, two's complement
UNSIGNED_RANGE = (0, 15)  # uint4


def _check_range(c: torch.Tensor, signed: bool) -> None:
    """Raise a ValueError naming the first code that no nibble of this kind can hold."""
    if c.numel() == 0:
        return
    lo, hi = SIGNED_RANGE if signed else UNSIGNED_RANGE
    if int(c.min()) < lo or int(c.max()) > hi:
        bad = ((c < lo) | (c > hi)).nonzero()[0].tolist()
        kind = "signed int4" if signed else "unsigned uint4"
        raise ValueError(
            f"code {int(c[tuple(bad)])} at index {tuple(bad)} is outside {lo}..{hi} "
            f"({kind}): a nibble cannot hold it and it would unpack as a different code; "
            "clamp the codes to the grid first"
            + (", or pass signed=False for uint4 codes 0..15" if signed else "")
        )


def pack_int4(codes: torch.Tensor, signed: bool | None = None) -> torch.Tensor:
    """Pack integer codes two per byte along the last axis.

    codes: integer tensor of shape (..., K) with K even.
    signed: True for int4 codes (-8..7, unpack with signed=True), False for uint4 codes
        (0..15, unpack with signed=False), None to follow the dtype: an unsigned dtype
        (uint8, as qlab stores asymmetric, NF4 and FP4 codes) means uint4, a signed one
        (int8, as qlab stores symmetric int codes; int64 too) means int4.
        A code outside that range raises a ValueError (it could not come back).
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
    if signed is None:
        signed = codes.is_signed()
    c = codes.to(torch.int16)
    _check_range(c, signed)
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
