"""Scale rules. Each takes blocks of shape (R, G, g) - R rows, G groups of g elements
along the last axis - and returns a RuleResult: codes (R, G, g), scales (R, G),
zero_points (R, G) or None, tensor_scale (a 0-d tensor, NVFP4 only) or None.

Every rule divides x by its scale (a true float32 division, never a multiply by a
reciprocal), except NF4, which follows bitsandbytes' order: x * fp32(1 / absmax) (its CUDA
kernels, built with --use_fast_math, take an approximate reciprocal, within 1 ulp), and the GGUF
rules, which follow llama.cpp's reference quantizer (ggml-quants.c): x * fp32(1 / d).
A group that is all zeros gets codes of 0.0 and dequantizes to zeros.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from qlab.formats import FLOATS
from qlab.schemes import ScaleRule, Scheme

FP8_E4M3 = FLOATS["fp8_e4m3fn"]
NVFP4_TENSOR_DIVISOR = FLOATS["fp4_e2m1fn"].max * FP8_E4M3.max  # 2688.0 = 6 * 448
NVFP4_BLOCK_SCALE_MIN = 2.0**-6  # smallest normal E4M3: all-zero blocks come back as zeros
NF4_DQ_BLOCK = 256  # QLoRA double quantization: one fp32 scale per 256 absmax values
# The second level of NF4 double quantization: int8, absmax rule, fp32 scales.
INT8_FP32 = Scheme(
    name="int8_fp32", element="int8", scale_rule="absmax", scale_bits=32,
    scale_dtype=torch.float32,
)  # fmt: skip


class RuleResult(NamedTuple):
    """What a scale rule returns (shapes for blocks of shape (R, G, g))."""

    codes: torch.Tensor  # (R, G, g) integer codes of the element grid
    scales: torch.Tensor  # (R, G) in scheme.scale_dtype (E8M0/E4M3 values as fp32)
    zero_points: torch.Tensor | None = None  # (R, G) uint8, asymmetric rules only
    tensor_scale: torch.Tensor | None = None  # () fp32, NVFP4's per-tensor scale


def _amax(blocks: torch.Tensor) -> torch.Tensor:
    """Max |x| over the last axis; an empty last axis gives 0. NaN propagates."""
    if blocks.shape[-1] == 0:
        return blocks.new_zeros(blocks.shape[:-1])
    return blocks.abs().amax(dim=-1)


def _nonzero(s: torch.Tensor) -> torch.Tensor:
    """Scale to divide by: 1 where the scale is 0 (all-zero group -> codes of 0)."""
    return torch.where(s == 0, torch.ones_like(s), s)


def _store(s: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    stored = s.to(scheme.scale_dtype)
    if bool(torch.isinf(stored).any()) or bool(((stored == 0) & (s > 0)).any()):
        bad = float(s.max()) if bool(torch.isinf(stored).any()) else float(s[s > 0].min())
        raise ValueError(
            f"a scale of {bad:.4g} is outside the range of {scheme.scale_dtype} in scheme "
            f"{scheme.name!r}; rescale the tensor or use "
            f"dataclasses.replace(qlab.get_scheme({scheme.name!r}), scale_dtype=torch.float32)"
        )
    return stored


def absmax(blocks: torch.Tensor, scheme: Scheme) -> RuleResult:
    """Symmetric: s = absmax / grid.max (stored in scheme.scale_dtype); codes = grid(x / s)."""
    grid = scheme.grid
    scales = _store(_amax(blocks) / grid.max, scheme)
    codes = grid.encode(blocks / _nonzero(scales.float())[..., None])
    return RuleResult(codes, scales)


def minmax(blocks: torch.Tensor, scheme: Scheme) -> RuleResult:
    """Asymmetric: s = (max - min) / (2^b - 1) over a range that includes 0,
    z = round(-min / s), q = clamp(round(x / s) + z, 0, 2^b - 1). Real 0 maps to q = z,
    so it dequantizes to exactly 0 (zero padding and ReLU zeros stay exact)."""
    grid = scheme.grid
    if blocks.shape[-1] == 0:
        lo = hi = blocks.new_zeros(blocks.shape[:-1])
    else:
        lo = torch.clamp(blocks.amin(dim=-1), max=0.0)
        hi = torch.clamp(blocks.amax(dim=-1), min=0.0)
    scales = _store((hi - lo) / grid.qmax, scheme)
    s = _nonzero(scales.float())
    zero_points = torch.clamp(torch.round(-lo / s), 0, grid.qmax)
    codes = grid.encode(torch.round(blocks / s[..., None]) + zero_points[..., None])
    return RuleResult(codes, scales, zero_points.to(torch.uint8))


def nf4(blocks: torch.Tensor, scheme: Scheme) -> RuleResult:
    """bitsandbytes' NF4 blockwise: codes = nf4(fp32(x * fp32(1/absmax))), absmax in fp32.

    With double quantization (QLoRA) the absmax values are quantized again: their mean
    is subtracted and the rest is stored as int8 with one fp32 absmax scale per 256
    values; dequantization then uses those reconstructed absmax values. (bitsandbytes
    stores them with its own 8-bit "dynamic" tree map instead of int8.)"""
    amax = _amax(blocks)
    inv = torch.where(amax == 0, torch.zeros_like(amax), 1.0 / amax)
    normalized = blocks * inv[..., None]
    if bool(torch.isinf(inv).any()):  # absmax < 2^-128: 1/absmax overflows, so divide instead
        normalized = torch.where(torch.isinf(inv)[..., None], blocks / amax[..., None], normalized)
    codes = scheme.grid.encode(normalized)
    scales = double_quantize(amax) if scheme.double_quant else amax
    return RuleResult(codes, scales)


def double_quantize(amax: torch.Tensor) -> torch.Tensor:
    """Reconstructed absmax after QLoRA-style double quantization (see nf4): the mean is
    subtracted, the rest quantized with the absmax rule on the int8 grid in blocks of 256
    (one fp32 scale each), then dequantized and the mean added back."""
    flat = amax.reshape(-1)
    if flat.numel() == 0:
        return amax
    offset = flat.mean()
    pad = (-flat.numel()) % NF4_DQ_BLOCK
    centred = torch.nn.functional.pad(flat - offset, (0, pad))
    r = absmax(centred.reshape(1, -1, NF4_DQ_BLOCK), INT8_FP32)  # shape: (1, G, 256)
    rebuilt = r.codes.float() * r.scales[..., None]  # int8 code * fp32 scale, exact product
    return (rebuilt.reshape(-1)[: flat.numel()] + offset).reshape(amax.shape)


def e8m0(blocks: torch.Tensor, scheme: Scheme) -> RuleResult:
    """OCP MX v1.0, section 6.3 (the conversion the spec recommends; implementations may
    round the scale up instead, e.g. torchao's RCEIL, which never clips the block's largest
    element): X = 2^(floor(log2(amax)) - emax_elem), clamped to
    [-127, 127] (the E8M0 range). floor(log2) is read from the float32 exponent bits,
    not computed with log2 (which rounds up just below powers of two). Elements are
    the grid's RNE saturating encode of x / X. An all-zero block gets X = 2^-127; a
    block holding NaN or inf gets a NaN scale, and so dequantizes to NaN."""
    grid = scheme.grid
    amax = _amax(blocks)
    exp_bits = (amax.view(torch.int32) >> 23) & 0xFF  # biased exponent; 0 for 0/subnormals
    shared = torch.clamp(exp_bits - 127 - grid.emax, -127, 127)
    scales = torch.ldexp(torch.ones_like(amax), shared)
    finite = torch.isfinite(amax)
    if bool(finite.all()):
        return RuleResult(grid.encode(blocks / scales[..., None]), scales)
    scales = torch.where(finite, scales, torch.full_like(scales, float("nan")))
    clean = torch.where(torch.isfinite(blocks), blocks, torch.zeros_like(blocks))
    codes = grid.encode(clean / torch.where(finite, scales, 1.0)[..., None])
    return RuleResult(codes, scales)


def nvfp4(blocks: torch.Tensor, scheme: Scheme) -> RuleResult:
    """NVFP4, all in fp32: ts = amax / 2688; bs = E4M3(clamp((block_amax / 6) / ts,
    2^-6, 448)); e = E2M1(x / (ts * bs)) RNE saturating; x_hat = e * (ts * bs).
    The clamp is an implementation choice (torchao's), not part of the format; some
    implementations skip the 2^-6 floor, and then an all-zero block divides 0 by 0."""
    grid = scheme.grid
    tensor_amax = _amax(blocks.reshape(1, -1))[0]
    ts = tensor_amax / NVFP4_TENSOR_DIVISOR
    block_amax = _amax(blocks)
    bs_hp = (block_amax / grid.max) / ts if float(ts) > 0 else torch.zeros_like(block_amax)
    bs_hp = torch.clamp(bs_hp, NVFP4_BLOCK_SCALE_MIN, FP8_E4M3.max)
    bs = FP8_E4M3.decode(FP8_E4M3.encode(bs_hp))
    codes = grid.encode(blocks / _nonzero(ts * bs)[..., None])
    return RuleResult(codes, bs, tensor_scale=ts)


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: nearest integer, ties away from zero (2.5 -> 3, -2.5 -> -3), exactly.
    (floor(v + 0.5) is not the same: 0.49999997 + 0.5 rounds to 1.0 in float32.)"""
    whole = torch.trunc(v)
    tie = (v - whole).abs() == 0.5  # the fractional part of a float32 is exact
    return torch.where(tie, whole + torch.sign(v), torch.round(v))


def ggml_q8_0(blocks: torch.Tensor, scheme: Scheme) -> RuleResult:
    """llama.cpp's quantize_row_q8_0_ref, all in fp32: d = absmax / 127, id = 1 / d (0 when
    d = 0), q = roundf(x * id): round half AWAY from zero, not qlab's half-to-even (C's
    roundf; gguf's numpy port does the same). d is rounded to fp16 only when stored, after
    the codes: the codes come from the fp32 d. An fp16 overflow (absmax > 127 * 65504) is
    stored as inf, as llama.cpp does, and dequantizes to inf/NaN."""
    d = _amax(blocks) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = torch.clamp(round_half_away(blocks * inv[..., None]), -127, 127)
    return RuleResult(codes.to(torch.int8), d.to(torch.float16))


def ggml_q4_0(blocks: torch.Tensor, scheme: Scheme) -> RuleResult:
    """llama.cpp's quantize_row_q4_0_ref (uint4 grid) and quantize_row_q5_0_ref (uint5), fp32:
    m = the element of largest |x| WITH its sign (the first one on ties), d = m / -2^(b-1),
    q = min(2^b - 1, trunc(x * (1 / d) + 2^(b-1) + 0.5)); x_hat = d * (q - 2^(b-1)).
    So m itself lands on code 0 (value -2^(b-1)): the grid is -8..7 for Q4_0, the extra
    negative level goes to the largest weight, and the other sign clamps at 7/8 of it.
    trunc(v + 0.5) of a non-negative v rounds ties UP (not to even), after v + 0.5 is
    rounded to fp32. zero_points hold the implied offset 2^(b-1); d is stored as fp16."""
    grid = scheme.grid
    half = (grid.qmax + 1) // 2
    amax = _amax(blocks)
    signed_max = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))[..., 0]
    signed_max = torch.where(amax == 0, torch.zeros_like(amax), signed_max)  # C starts at +0.0
    d = signed_max / -float(half)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    codes = torch.clamp(torch.trunc(blocks * inv[..., None] + (half + 0.5)), 0, grid.qmax)
    zero_points = torch.full_like(d, half, dtype=torch.uint8)
    return RuleResult(codes.to(torch.uint8), d.to(torch.float16), zero_points)


RULES: dict[ScaleRule, Callable[[torch.Tensor, Scheme], RuleResult]] = {
    "absmax": absmax, "minmax": minmax, "nf4": nf4, "e8m0": e8m0, "nvfp4": nvfp4,
    "ggml_q8_0": ggml_q8_0, "ggml_q4_0": ggml_q4_0,
}  # fmt: skip
