"""GGUF's K-quants: super-blocks of 256 whose sub-block scales are quantized again.

The documented extension of qlab's one-scale-per-group model (DESIGN.md): two levels of
scales, like NF4's double quantization. A super-block of 256 weights is cut into
sub-blocks; each sub-block's scale (and min) is stored as a small integer times one fp16
super-block scale:

    type  sub-blocks  element           sub-block scale / min         value of element  bits
    Q3_K  16 x 16     q 0..7 (3 bits)   6-bit signed sc - 32, d fp16  d * (sc-32) * (q-4)  3.4375
    Q4_K   8 x 32     q 0..15           6-bit sc, m; d, dmin fp16     d*sc * q - dmin*m    4.5
    Q5_K   8 x 32     q 0..31           6-bit sc, m; d, dmin fp16     d*sc * q - dmin*m    5.5
    Q6_K  16 x 16     q 0..63           int8 sc, d fp16               d*sc * (q - 32)      6.5625

bits per weight = bytes * 8 / 256: Q4_K (2 + 2 + 12 + 128) bytes -> 4.5 (4 bits + 6+6 bits per
32 + 32 bits per 256); Q6_K (128 + 64 + 16 + 2) -> 6.5625 (6 + 8/16 + 16/256).

Encoding is llama.cpp's reference quantizer (quantize_row_q4_K_ref etc.): a per-sub-block
scale search (qlab/gguf/search.py), the sub-block scales rounded onto the 6- or 8-bit grid
of the largest one (super-block scale = max / 63, or -max / 128 for Q6_K, -max / 32 for
Q3_K), then every weight re-rounded against the scale it will actually be decoded with
(fp16 d times the integer sub-scale): nearest_int((x + dmin * m) / (d * sc)). A sub-block
whose decoded scale is 0 keeps the codes of its search. With an importance matrix the
_impl variants run (make_qkx3_quants + make_qp_quants for Q4_K/Q5_K, weighted
make_qx_quants for Q3_K/Q6_K).

Search weights, per element (llama.cpp's choices, not one formula):
    Q4_K, Q5_K   reference av_x + |x|, av_x = sqrt(mean x^2 over the sub-block of 32);
                 imatrix   im_j * sqrt(sigma2 + x_j^2), sigma2 = 2 * sum(x^2) / 256 over the
                           super-block
    Q3_K         reference x^2 (make_q3_quants); imatrix as Q4_K
    Q6_K         reference x^2; imatrix im_j itself

Edge cases, as in C: a sub-block whose scale search returns NaN (its weighted sums overflow
float32, e.g. one weight of 1e19 among small ones) is skipped when the largest scale is
picked and stored with sub-scale 0 (nearest_int(NaN) = 0), so the rest of the super-block
decodes normally. A super-block whose sums overflow in every path llama.cpp takes (Q4_K,
Q5_K, or Q6_K with an imatrix, on such a block) gets a NaN or inf fp16 scale in llama.cpp
and in qlab alike.
"""

from __future__ import annotations

import torch

from qlab.gguf._ggml import (
    GROUP_MAX_EPS,
    QK_K,
    as_i8,
    as_u8,
    div,
    f32,
    first_absmax,
    fp16,
    nearest_int,
    sqrtf,
    sum_from_zero,
)
from qlab.gguf.search import make_q3_quants, make_qkx, make_qp_quants, make_qx_quants

_SHIFT2 = torch.arange(0, 8, 2, dtype=torch.int32)  # 2-bit fields of a byte: 0, 2, 4, 6
_SHIFT1 = torch.arange(8, dtype=torch.int32)


def _u16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(-1)


def _or_shifted(parts: torch.Tensor, shifts: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of parts << shifts along dim (the fields do not overlap, so sum == OR) -> uint8."""
    shape = [1] * parts.dim()
    shape[dim] = -1
    return (parts.to(torch.int32) << shifts.reshape(shape)).sum(dim=dim).to(torch.uint8)


# --------------------------------------------------------------------------- 6-bit scales


def pack_scales_k4(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins (N, 8) -> 12 bytes (N, 12).

        bytes 0-3   sc[0..3] | (sc[4..7] >> 4) << 6
        bytes 4-7   m[0..3]  | (m[4..7] >> 4) << 6
        bytes 8-11  (sc[4..7] & 0xF) | (m[4..7] & 0xF) << 4
    """
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    return torch.cat(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4),
        ],
        dim=1,
    )


def unpack_scales_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes (N, 12) -> (sc, m), each (N, 8) uint8 in 0..63 (ggml's get_scale_min_k4)."""
    lo, mid, hi = b[:, 0:4], b[:, 4:8], b[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], dim=1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc, m


def pack_scales_q3(s: torch.Tensor) -> torch.Tensor:
    """Q3_K: sixteen 6-bit scales (N, 16) -> 12 bytes: low nibbles of s[0..7] and s[8..15] in
    bytes 0-7 (low, high nibble), the top 2 bits of s[4g + r] in bits 2g of byte 8 + r."""
    s = s.to(torch.uint8)
    low = (s[:, :8] & 0xF) | ((s[:, 8:] & 0xF) << 4)
    top = (s >> 4).reshape(-1, 4, 4)  # shape: (N, g, r)
    return torch.cat([low, _or_shifted(top, _SHIFT2, dim=1)], dim=1)


def unpack_scales_q3(b: torch.Tensor) -> torch.Tensor:
    """12 bytes (N, 12) -> sixteen 6-bit scales (N, 16) uint8 (value sc - 32)."""
    low = torch.cat([b[:, :8] & 0xF, b[:, :8] >> 4], dim=1)
    top = (b[:, 8:12].to(torch.int32)[:, None, :] >> _SHIFT2[None, :, None]) & 3  # (N, g, r)
    return (low.to(torch.int32) | (top.reshape(-1, 16) << 4)).to(torch.uint8)


# --------------------------------------------------------------------------- element layouts


def _pack_q4(q: torch.Tensor) -> torch.Tensor:
    """(N, 256) codes -> 128 bytes: chunk c of 64 codes -> 32 bytes, code 64c + l in the low
    nibble and 64c + 32 + l in the high nibble of byte 32c + l."""
    q = (q.to(torch.uint8) & 0xF).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(-1, QK_K)


def _pack_q6(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 256) codes 0..63 -> ql (N, 128), qh (N, 64). Half h, quarter k, lane l is code
    128h + 32k + l: low nibbles of quarters 0|2 and 1|3 share ql bytes, the top 2 bits of
    the four quarters fill qh[32h + l] at bits 0, 2, 4, 6."""
    q = q.to(torch.int32).reshape(-1, 2, 4, 32)  # shape: (N, h, k, l)
    low = q & 0xF
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).to(torch.uint8).reshape(-1, 128)
    qh = _or_shifted(q >> 4, _SHIFT2, dim=2).reshape(-1, 64)
    return ql, qh


def _unpack_q6(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    ql = ql.to(torch.int32).reshape(-1, 2, 2, 32)
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # shape: (N, h, k, l)
    top = (qh.to(torch.int32).reshape(-1, 2, 1, 32) >> _SHIFT2[None, None, :, None]) & 3
    return (low | (top << 4)).to(torch.uint8).reshape(-1, QK_K)


def _pack_q3(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 256) codes 0..7 -> hmask (N, 32): bit b of byte m = bit 2 of code 32b + m;
    qs (N, 64): low 2 bits, code 128c + 32k + l at bits 2k of byte 32c + l."""
    q = q.to(torch.int32)
    hmask = _or_shifted(((q >> 2) & 1).reshape(-1, 8, 32), _SHIFT1, dim=1)
    qs = _or_shifted((q & 3).reshape(-1, 2, 4, 32), _SHIFT2, dim=2).reshape(-1, 64)
    return hmask, qs


def _unpack_q3(hmask: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    low = (qs.to(torch.int32).reshape(-1, 2, 1, 32) >> _SHIFT2[None, None, :, None]) & 3
    hi = (hmask.to(torch.int32)[:, None, :] >> _SHIFT1[None, :, None]) & 1  # shape: (N, b, m)
    return (low.reshape(-1, QK_K) | (hi.reshape(-1, QK_K) << 2)).to(torch.uint8)


def pack(name: str, f: dict) -> torch.Tensor:
    """Fields of N super-blocks -> the bytes (N, type size) llama.cpp writes."""
    if name in ("Q4_K", "Q5_K"):
        parts = [_u16(f["d"]), _u16(f["dmin"]), pack_scales_k4(f["sc"], f["m"])]
        if name == "Q5_K":
            parts.append(_or_shifted((f["q"].to(torch.int32) >> 4).reshape(-1, 8, 32),
                                     _SHIFT1, dim=1))  # fmt: skip
        return torch.cat([*parts, _pack_q4(f["q"])], dim=1)
    if name == "Q6_K":
        ql, qh = _pack_q6(f["q"])
        return torch.cat([ql, qh, f["sc"].to(torch.int8).view(torch.uint8), _u16(f["d"])], 1)
    hmask, qs = _pack_q3(f["q"])  # Q3_K
    return torch.cat([hmask, qs, pack_scales_q3(f["sc"]), _u16(f["d"])], dim=1)


def unpack(name: str, b: torch.Tensor) -> dict:
    """Bytes (N, type size) -> fields (d, dmin fp16 (N,); sc, m (N, 8 or 16); q (N, 256))."""
    if name in ("Q4_K", "Q5_K"):
        sc, m = unpack_scales_k4(b[:, 4:16])
        q = _unpack_q4(b[:, -128:])
        if name == "Q5_K":
            hi = (b[:, 16:48].to(torch.int32)[:, None, :] >> _SHIFT1[None, :, None]) & 1
            q = q | (hi.reshape(-1, QK_K) << 4).to(torch.uint8)
        return {"d": _f16(b[:, 0:2]), "dmin": _f16(b[:, 2:4]), "sc": sc, "m": m, "q": q}
    if name == "Q6_K":
        sc = b[:, 192:208].contiguous().view(torch.int8)
        return {"d": _f16(b[:, 208:210]), "sc": sc, "q": _unpack_q6(b[:, :128], b[:, 128:192])}
    return {  # Q3_K
        "d": _f16(b[:, 108:110]),
        "sc": unpack_scales_q3(b[:, 96:108]),
        "q": _unpack_q3(b[:, :32], b[:, 32:96]),
    }


def dequantize(name: str, f: dict) -> torch.Tensor:
    """Fields -> float32 (N, 256), in gguf's (and ggml's) order of operations, bit-exact:
    Q4_K/Q5_K (d * sc) * q - (dmin * m); Q6_K (d * sc) * (q - 32);
    Q3_K (d * (sc - 32)) * (q - 4)."""
    d = f["d"].to(torch.float32)[:, None]
    if name in ("Q4_K", "Q5_K"):
        scale = (d * f["sc"].to(torch.float32)).repeat_interleave(32, dim=1)
        mn = (f["dmin"].to(torch.float32)[:, None] * f["m"].to(torch.float32))
        return scale * f["q"].to(torch.float32) - mn.repeat_interleave(32, dim=1)
    if name == "Q6_K":
        scale = (d * f["sc"].to(torch.float32)).repeat_interleave(16, dim=1)
        return scale * (f["q"].to(torch.float32) - 32.0)
    scale = (d * (f["sc"].to(torch.float32) - 32.0)).repeat_interleave(16, dim=1)  # Q3_K
    return scale * (f["q"].to(torch.float32) - 4.0)


# --------------------------------------------------------------------------- encoding


def _requantize(x, d, sub_scale, sub_min, L, sub: int, qmax: int, offset: int):
    """The final pass of every K-quant: each weight re-rounded against the scale it will be
    decoded with, l = nearest_int((x + dm) / (d * sc)) clamped to [-offset, qmax - offset],
    stored + offset (codes 0..qmax). Sub-blocks whose decoded scale is 0 keep the codes L of
    their search."""
    dq = (d.to(torch.float32)[:, None] * sub_scale).repeat_interleave(sub, dim=1)  # (N, 256)
    dm = 0.0 if sub_min is None else sub_min.repeat_interleave(sub, dim=1)
    safe = torch.where(dq == 0, torch.ones_like(dq), dq)
    lv = torch.clamp(nearest_int((x + dm) / safe), -offset, qmax - offset) + offset
    return torch.where(dq == 0, L, lv).to(torch.uint8)


def _k4_sub_weights(x: torch.Tensor, imatrix: torch.Tensor | None) -> torch.Tensor:
    """Q4_K/Q5_K search weights per element, (N * 8, 32). Reference: av_x + |x| with av_x
    = sqrtf(sum_x2 / 32) over the sub-block. imatrix: qw * sqrtf(sigma2 + x^2), sigma2 =
    2 * sum_x2 / 256 over the super-block."""
    if imatrix is None:
        sub = x.reshape(-1, 32)
        av_x = sqrtf(sum_from_zero(sub * sub) / 32.0)
        return av_x[:, None] + sub.abs()
    sigma2 = (2.0 * sum_from_zero(x * x)) / float(QK_K)
    return (imatrix * sqrtf(sigma2[:, None] + x * x)).reshape(-1, 32)


def _quantize_k45(x: torch.Tensor, imatrix: torch.Tensor | None, nmax: int) -> dict:
    """Q4_K (nmax 15) / Q5_K (31): quantize_row_q{4,5}_K_ref, or _impl with an imatrix."""
    n = x.shape[0]
    w = _k4_sub_weights(x, imatrix)
    if imatrix is None:
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, L = make_qkx(x.reshape(-1, 32), w, nmax, rmin, f32(0.1), nstep)
        scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
        max_scale, max_min = scales.amax(dim=1), mins.amax(dim=1)  # C: from +0.0, `if (v > max)`
        max_scale = torch.where(max_scale > 0, max_scale, 0.0)
        max_min = torch.where(max_min > 0, max_min, 0.0)
        inv_scale = torch.where(max_scale > 0, div(63.0, max_scale), 0.0)
        inv_min = torch.where(max_min > 0, div(63.0, max_min), 0.0)
        ls = torch.clamp(as_u8(nearest_int(inv_scale[:, None] * scales)), max=63)
        lm = torch.clamp(as_u8(nearest_int(inv_min[:, None] * mins)), max=63)
        d, dmin = fp16(max_scale / 63.0), fp16(max_min / 63.0)
    else:
        sw = sum_from_zero(w).reshape(n, 8)
        scales, mins, L = make_qkx(x.reshape(-1, 32), w, nmax, f32(-0.9), f32(0.05), 36)
        d_block, ls = make_qp_quants(scales.reshape(n, 8), 63, sw)
        m_block, lm = make_qp_quants(mins.reshape(n, 8), 63, sw)
        d, dmin = fp16(d_block), fp16(m_block)
        if nmax == 31:  # Q5_K_impl clamps to 63; Q4_K_impl packs all 8 bits of a code 255
            ls, lm = torch.clamp(ls, max=63), torch.clamp(lm, max=63)
    # the 6-bit scales and mins as they will be decoded: a 255 that Q4_K_impl packs reads
    # back as 63, and its top bits land in another sub-block's scale (pack_scales_k4)
    sc6, m6 = unpack_scales_k4(pack_scales_k4(ls, lm))
    sub_min = dmin.to(torch.float32)[:, None] * m6.to(torch.float32)
    q = _requantize(x, d, sc6.to(torch.float32), sub_min, L.reshape(n, QK_K), 32, nmax, 0)
    return {"d": d, "dmin": dmin, "sc": ls.to(torch.uint8), "m": lm.to(torch.uint8), "q": q}


def _quantize_q6(x: torch.Tensor, imatrix: torch.Tensor | None) -> dict:
    """quantize_row_q6_K_ref (weights x^2) or _impl (weights = the imatrix itself)."""
    n = x.shape[0]
    qw = None if imatrix is None else imatrix.expand_as(x).reshape(-1, 16)
    scales, L = make_qx_quants(x.reshape(-1, 16), 32, qw)
    scales = scales.reshape(n, 16)
    max_abs, max_scale = first_absmax(scales)
    zero = max_abs < GROUP_MAX_EPS  # the whole super-block is stored as zero bytes
    iscale = div(-128.0, torch.where(zero, torch.ones_like(max_scale), max_scale))
    d = torch.where(zero, 0.0, fp16(div(1.0, iscale)).to(torch.float32)).to(torch.float16)
    sc = as_i8(torch.clamp(nearest_int(iscale[:, None] * scales), max=127))
    sc = torch.where(zero[:, None], torch.zeros_like(sc), sc)
    q = _requantize(x, d, sc.to(torch.float32), None, L.reshape(n, QK_K), 16, 63, 32)
    q = torch.where(zero[:, None], torch.zeros_like(q), q)
    return {"d": d, "sc": sc, "q": q}


def _quantize_q3(x: torch.Tensor, imatrix: torch.Tensor | None) -> dict:
    """quantize_row_q3_K_ref (make_q3_quants, scales onto -32 * s / max_scale) or _impl
    (weighted make_qx_quants for the codes and again for the 16 scales)."""
    n = x.shape[0]
    sub = x.reshape(-1, 16)
    if imatrix is None:
        scales, L = make_q3_quants(sub, 4)
        scales = scales.reshape(n, 16)
        _, max_scale = first_absmax(scales)
        nonzero = max_scale != 0
        iscale = div(-32.0, torch.where(nonzero, max_scale, torch.ones_like(max_scale)))
        s6 = torch.clamp(as_i8(nearest_int(iscale[:, None] * scales)).to(torch.int32), -32, 31)
        s6 = torch.where(nonzero[:, None], s6 + 32, 0)
        d = torch.where(nonzero, fp16(div(1.0, iscale)).to(torch.float32), 0.0)
        d = d.to(torch.float16)
    else:
        sigma2 = (2.0 * sum_from_zero(x * x)) / float(QK_K)
        w = (imatrix * sqrtf(sigma2[:, None] + x * x)).reshape(-1, 16)
        scales, L = make_qx_quants(sub, 4, w)
        d_block, s6 = make_qx_quants(scales.reshape(n, 16), 32, sum_from_zero(w).reshape(n, 16))
        d = fp16(d_block)
    sc = (s6.to(torch.int32) - 32).to(torch.float32)
    q = _requantize(x, d, sc, None, L.reshape(n, QK_K), 16, 7, 4)
    return {"d": d, "sc": s6.to(torch.uint8), "q": q}


def quantize(name: str, rows: torch.Tensor, imatrix: torch.Tensor | None = None) -> dict:
    """float32 (R, K) rows, K a multiple of 256 -> fields of the R * K / 256 super-blocks.
    imatrix: (K,) column importance (None: the reference quantizer)."""
    x = rows.reshape(-1, QK_K)
    im = None
    if imatrix is not None:  # the same K weights for every row, cut like the row
        im = imatrix.to(torch.float32).repeat(rows.shape[0]).reshape(-1, QK_K)
    if name == "Q4_K":
        return _quantize_k45(x, im, 15)
    if name == "Q5_K":
        return _quantize_k45(x, im, 31)
    if name == "Q6_K":
        return _quantize_q6(x, im)
    return _quantize_q3(x, im)
