"""GGUF's blocks of 32 ("legacy" quants): Q8_0, Q4_0, Q5_0, Q4_1, Q5_1.

    type  bytes  layout (little-endian)                 value of element j      bits/weight
    Q8_0  34     d fp16 | q int8 x32                    d * q                   8.5
    Q4_0  18     d fp16 | qs[16]                        d * (q - 8)             4.5
    Q5_0  22     d fp16 | qh u32 | qs[16]               d * (q - 16)            5.5
    Q4_1  20     d fp16 | m fp16 | qs[16]               d * q + m               5.0
    Q5_1  24     d fp16 | m fp16 | qh u32 | qs[16]      d * q + m               6.0

Nibble order: byte qs[j] holds element j in its LOW nibble and element j + 16 in its HIGH
nibble (the block's first half in the low nibbles). That is NOT qlab.pack_int4's order
(elements 2j and 2j + 1 share a byte). Bit j of qh is bit 4 of element j (Q5_*).

Encoding: Q8_0, Q4_0 and Q5_0 are qlab schemes ("q8_0", "q4_0", "q5_0", rules in
qlab/scales.py) and are quantized by qlab.quantize. Q4_1 and Q5_1 (a scale and a min per
block, d * q + m, not qlab's s * (q - z) with an integer z) are here: quantize_row_q4_1_ref:
min and max of the block, d = (max - min) / 15, q = min(15, (int)((x - min) * (1 / d) + 0.5)).
With an importance matrix every type but Q8_0 uses llama.cpp's weighted searches instead
(quantize_row_q4_0_impl ...): weights imatrix[j] * sqrt(sigma2 + x_j^2), sigma2 the mean
square of the row.
"""

from __future__ import annotations

import torch

from qlab.gguf._ggml import div, f32, first_max, first_min, fp16, sqrtf, sum_from_zero
from qlab.gguf.search import make_qkx, make_qx_quants
from qlab.quantize import quantize as qlab_quantize

QK = 32
_BITS_J = torch.arange(8, dtype=torch.int32)  # bit k of a byte <- element 8 * byte + k


def _u16(v: torch.Tensor) -> torch.Tensor:
    """fp16 (N,) -> its two little-endian bytes (N, 2)."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes (N, 2) -> fp16 (N,)."""
    return b.contiguous().view(torch.float16).reshape(-1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, 32) codes -> (N, 16) bytes: element j low nibble, element j + 16 high nibble."""
    q = q.to(torch.uint8) & 0xF
    return q[:, :16] | (q[:, 16:] << 4)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) bytes -> (N, 32) codes 0..15 (inverse of pack_nibbles)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def _pack_qh(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 codes -> a little-endian uint32 as 4 bytes (N, 4)."""
    hi = ((q.to(torch.int32) >> 4) & 1).reshape(-1, 4, 8)  # shape: (N, byte, bit)
    return (hi << _BITS_J).sum(dim=2).to(torch.uint8)


def _unpack_qh(qh: torch.Tensor) -> torch.Tensor:
    """(N, 4) bytes -> (N, 32) values 0 or 16."""
    bits = (qh.to(torch.int32)[:, :, None] >> _BITS_J) & 1  # shape: (N, byte, bit)
    return (bits.reshape(-1, 32) << 4).to(torch.uint8)


# --------------------------------------------------------------------------- layouts


def pack(name: str, f: dict) -> torch.Tensor:
    """Fields of N blocks -> the bytes (N, type size) llama.cpp writes."""
    q = f["q"]
    if name == "Q8_0":
        return torch.cat([_u16(f["d"]), q.to(torch.int8).view(torch.uint8)], dim=1)
    parts = [_u16(f["d"])]
    if name in ("Q4_1", "Q5_1"):
        parts.append(_u16(f["m"]))
    if name in ("Q5_0", "Q5_1"):
        parts.append(_pack_qh(q))
    return torch.cat([*parts, pack_nibbles(q)], dim=1)


def unpack(name: str, b: torch.Tensor) -> dict:
    """Bytes (N, type size) -> fields: d (and m) fp16 (N,), q (N, 32) uint8 (int8 for Q8_0)."""
    f = {"d": _f16(b[:, 0:2])}
    if name == "Q8_0":
        f["q"] = b[:, 2:].contiguous().view(torch.int8)
        return f
    at = 2
    if name in ("Q4_1", "Q5_1"):
        f["m"], at = _f16(b[:, 2:4]), 4
    q = unpack_nibbles(b[:, -16:])
    if name in ("Q5_0", "Q5_1"):
        q = q | _unpack_qh(b[:, at : at + 4])
    f["q"] = q
    return f


def dequantize(name: str, f: dict) -> torch.Tensor:
    """Fields -> float32 (N, 32), in gguf's order of operations (bit-exact)."""
    d = f["d"].to(torch.float32)[:, None]
    q = f["q"].to(torch.float32)
    if name == "Q8_0":
        return q * d
    if name in ("Q4_1", "Q5_1"):
        return d * q + f["m"].to(torch.float32)[:, None]
    return d * (q - (8.0 if name == "Q4_0" else 16.0))


# --------------------------------------------------------------------------- encoding


def _x86_codes_if_inverse_overflows(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Codes (N, 32) of the blocks whose fp32 d is nonzero but so small that id = 1 / d
    overflows to inf (|d| < 1/FLT_MAX ~ 2.9e-39: for Q8_0 an absmax below ~3.7e-37). C then
    converts x * id = +-inf (or 0 * inf = NaN) to an integer, which the C standard leaves
    undefined; x86-64's conversion gives 0x80000000, whose low byte 0 is then every code of
    the block, and gguf's numpy port gives the same bytes there. qlab writes those bytes.
    Such a d rounds to fp16 0, so the block decodes to zeros whatever its codes; only the
    sign of each zero (0 * (q - 8) = -0 for Q4_0's code 0) follows them."""
    over = (d != 0) & torch.isinf(div(1.0, d))
    return torch.where(over[:, None], torch.zeros_like(q), q)


def _fields_from_qlab(name: str, rows: torch.Tensor) -> dict:
    """Q8_0 / Q4_0 / Q5_0 through qlab.quantize (one scheme row each in qlab/schemes.py)."""
    qt = qlab_quantize(rows, name.lower())
    blocks = rows.reshape(-1, QK)
    d = blocks.abs().amax(dim=1) / {"Q8_0": 127.0, "Q4_0": 8.0, "Q5_0": 16.0}[name]  # |fp32 d|
    q = _x86_codes_if_inverse_overflows(qt.codes.reshape(-1, QK), d)
    return {"d": qt.scales.reshape(-1), "q": q}


def _minmax_ref(blocks: torch.Tensor, nmax: int) -> dict:
    """quantize_row_q4_1_ref / q5_1_ref: d = (max - min) / nmax, id = 1 / d (0 if d = 0),
    q = (int)((x - min) * id + 0.5), clamped to nmax (ties round up; 0.5 is added in fp32).
    m = min, stored as fp16 with d."""
    lo, hi = first_min(blocks), first_max(blocks)  # signs of zeros: m, and d = (hi - lo) / n
    d = (hi - lo) / float(nmax)
    inv = torch.where(d == 0, torch.zeros_like(d), div(1.0, torch.where(d == 0, 1.0, d)))
    v = (blocks - lo[:, None]) * inv[:, None] + 0.5
    q = _x86_codes_if_inverse_overflows(torch.clamp(torch.trunc(v), 0, nmax), d)
    return {"d": fp16(d), "m": fp16(lo), "q": q.to(torch.uint8)}


def _importance(rows: torch.Tensor, imatrix: torch.Tensor) -> torch.Tensor:
    """llama.cpp's weights for the legacy types: imatrix[j] * sqrtf(sigma2 + x_j^2), with
    sigma2 = (sum over the ROW of x^2) / n_per_row. Returns (R * K / 32, 32)."""
    sigma2 = sum_from_zero(rows * rows) / float(rows.shape[1])  # shape: (R,)
    w = imatrix[None, :] * sqrtf(sigma2[:, None] + rows * rows)
    return w.reshape(-1, QK)


def quantize(name: str, rows: torch.Tensor, imatrix: torch.Tensor | None = None) -> dict:
    """float32 (R, K) rows -> fields of the R * K / 32 blocks, row-major. imatrix: (K,)
    importance of each column (None: llama.cpp's reference quantizer)."""
    if name == "Q8_0" or (imatrix is None and name in ("Q4_0", "Q5_0")):
        return _fields_from_qlab(name, rows)  # llama.cpp ignores an imatrix for Q8_0
    blocks = rows.reshape(-1, QK)
    nmax = 15 if name in ("Q4_0", "Q4_1") else 31
    if imatrix is None:
        return _minmax_ref(blocks, nmax)
    w = _importance(rows, imatrix)
    if name in ("Q4_0", "Q5_0"):  # make_qx_quants(32, 8 or 16, x, L, 1, weights)
        d, L = make_qx_quants(blocks, (nmax + 1) // 2, w)
        return {"d": fp16(d), "q": L.to(torch.uint8)}
    d, the_min, L = make_qkx(blocks, w, nmax, f32(-0.9), f32(0.05), 36)
    return {"d": fp16(d), "m": fp16(-the_min), "q": L.to(torch.uint8)}
