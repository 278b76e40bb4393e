"""What the benchmark runs: our kernels and the baselines, each with the check of its output.

    torch_bf16        F.linear(x, W) in bf16: cuBLAS, the thing to beat
    w4a16             qlab.kernels.w4a16_linear
    tinygemm          torch._weight_int4pack_mm: PyTorch's own int4 GEMM (the tinygemm kernel)
    dequant_bf16      qlab.kernels.dequantize_int4 to a bf16 W, then F.linear: the naive way
    fp8 / fp8_fast    qlab.kernels.fp8_linear, end to end (activation quantization included)
    fp8_gemm(_fast)   qlab.kernels.fp8_scaled_mm, the GEMM alone
    torch_scaled_mm(_fast)  torch._scaled_mm on the same operands, the GEMM alone
    torch_fp8(_fast)  torch eager activation quantization + torch._scaled_mm, end to end
"_fast" runs with fast FP8 accumulation on both sides (use_fast_accum=True): like for like.

tinygemm's format differs from qlab's in two ways, both handled in tinygemm_weight: it
stores uint4 = code + 8 (dequantizing (u - 8) * scale + zero, zero = 0 here), and on CUDA
it packs the EVEN k into the HIGH nibble (qlab: low). Its scales are bf16, so its reference
uses qlab's fp16 scales rounded to bf16.

Every output is checked against a qlab reference (Reference: computed once per x and
layer) with the bounds of kernels/tolerance.py before it is timed; a candidate that fails
is reported and not timed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import qlab
from qlab.kernels.dequant import dequantize_int4
from qlab.kernels.fp8 import FP8Weight, fp8_linear, fp8_scaled_mm, pack_fp8, quantize_act_fp8
from qlab.kernels.tolerance import first_violation, fp8_bound, w4a16_bound
from qlab.kernels.w4a16 import W4A16Weight, pack_w4a16, w4a16_linear

__all__ = [
    "Candidate", "Weights", "Reference", "prepare", "candidates", "tinygemm_bytes",
    "tinygemm_weight",
]

TINYGEMM_INNER_K_TILES = 8  # K must be a multiple of 8 * 16


@dataclass
class Weights:
    """One layer's weight in every format the candidates read (plus the references)."""

    bf16: torch.Tensor  # (N, K)
    w4: W4A16Weight
    w4_hat: torch.Tensor  # float32 (N, K): qlab.dequantize of the int4 weight
    tinygemm: tuple | None  # (packed, scales_and_zeros), None where unsupported
    w8: FP8Weight | None  # None without FP8 tensor cores
    w8_hat: torch.Tensor | None  # float32 (N, K)


@dataclass
class Candidate:
    """setup(x, weights) -> args, outside the timing (e.g. quantizing x for GEMM-only);
    fn(*args) -> y is what is timed; check(y, reference) -> None or what is wrong."""

    name: str
    setup: Callable[[torch.Tensor, Weights], tuple]
    fn: Callable[..., torch.Tensor]
    check: Callable[[torch.Tensor, "Reference"], str | None]
    weight_bytes: Callable[[Weights], int]  # bytes of weight it reads (for L2-cold copies)


def tinygemm_bytes(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (N, K) -> the uint8 (N, K // 2) torch._convert_weight_to_int4pack takes on
    CUDA: uint4 = code + 8, the EVEN k in the HIGH nibble (qlab.pack_int4 puts it low)."""
    u = codes.to(torch.int32) + 8
    return (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)


def tinygemm_weight(w4: W4A16Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """qlab's int4 weight in tinygemm's format: (packed, scales_and_zeros bf16 (K/g, N, 2))."""
    codes = qlab.unpack_int4(w4.packed)  # int8 (N, K)
    if codes.device.type == "cuda":
        packed = torch._convert_weight_to_int4pack(tinygemm_bytes(codes), TINYGEMM_INNER_K_TILES)
    else:  # the CPU variant takes one uint4 per int32: same values, no nibble order
        u = codes.to(torch.int32) + 8
        packed = torch._convert_weight_to_int4pack_for_cpu(u, TINYGEMM_INNER_K_TILES)
    scales = w4.scales.to(torch.bfloat16)  # shape: (N, K // g)
    scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1)
    return packed, scales_and_zeros.transpose(0, 1).contiguous()  # shape: (K // g, N, 2)


def _tinygemm(x, packed, scales_and_zeros, group_size) -> torch.Tensor:
    mm = torch._weight_int4pack_mm if x.is_cuda else torch._weight_int4pack_mm_for_cpu
    return mm(x, packed, group_size, scales_and_zeros)


def _dequant_then_bf16(x, w4: W4A16Weight) -> torch.Tensor:
    w_16 = dequantize_int4(w4.packed, w4.scales, w4.group_size, out_dtype=x.dtype)
    return F.linear(x, w_16)


def _torch_fp8(x: torch.Tensor, w8: FP8Weight, fast: bool) -> torch.Tensor:
    """Per-token E4M3 activations the eager-torch way, then torch._scaled_mm."""
    s = x.float().abs().amax(dim=1) / 448.0  # qlab's rule: amax / 448, a true division
    q = (x.float() / torch.where(s == 0, 1.0, s)[:, None]).to(torch.float8_e4m3fn)
    return _scaled_mm(q, s, w8, fast)


def _scaled_mm(q: torch.Tensor, s: torch.Tensor, w8: FP8Weight, fast: bool) -> torch.Tensor:
    return torch._scaled_mm(q, w8.codes.T, scale_a=s[:, None], scale_b=w8.scales[None, :],
                            out_dtype=torch.bfloat16, use_fast_accum=fast)  # fmt: skip


def prepare(weight: torch.Tensor, group_size: int, fp8: bool) -> Weights:
    """Quantize and pack a bf16 weight (N, K) for every candidate, on weight's device.
    qlab's dequantized weights (the references) are computed on the CPU, where qlab is
    tested, and moved to the device once."""
    device = weight.device
    w_cpu = weight.cpu()
    w4 = pack_w4a16(weight, group_size)
    w4_hat = qlab.dequantize(qlab.quantize(w_cpu, "int4", group_size)).to(device)
    try:
        tiny = tinygemm_weight(w4)
    except (RuntimeError, AttributeError):  # no tinygemm for this torch / device
        tiny = None
    w8 = w8_hat = None
    if fp8:
        w8 = pack_fp8(weight, "channel")
        w8_hat = qlab.dequantize(qlab.quantize(w_cpu, "fp8_e4m3", "channel")).to(device)
    return Weights(weight, w4, w4_hat, tiny, w8, w8_hat)


class Reference:
    """qlab's float32 results for one x and one layer, each computed once (on x's device;
    x is quantized on the CPU) and shared by every candidate's check."""

    def __init__(self, x: torch.Tensor, w: Weights):
        self.x, self.w = x, w

    @functools.cached_property
    def bf16(self) -> torch.Tensor:
        return self.x.float() @ self.w.bf16.float().T

    @functools.cached_property
    def w4(self) -> torch.Tensor:
        return self.x.float() @ self.w.w4_hat.T

    @functools.cached_property
    def tinygemm_w_hat(self) -> torch.Tensor:
        """tinygemm's W_hat: qlab's codes times the scales rounded to bf16."""
        w4 = self.w.w4
        codes = qlab.unpack_int4(w4.packed).float()
        scales = w4.scales.to(torch.bfloat16).float().repeat_interleave(w4.group_size, dim=1)
        return codes * scales

    @functools.cached_property
    def tinygemm(self) -> torch.Tensor:
        return self.x.float() @ self.tinygemm_w_hat.T

    @functools.cached_property
    def fp8_x_hat(self) -> torch.Tensor:
        """x per token in E4M3, dequantized: qlab.quantize(x, "fp8_e4m3", "channel")."""
        qx = qlab.quantize(self.x.cpu(), "fp8_e4m3", "channel")
        return qlab.dequantize(qx).to(self.x.device)

    @functools.cached_property
    def fp8(self) -> torch.Tensor:
        """qlab.pipelines.w8a8_reference's value, from the dequantized operands (the same
        exact products, scaled per element rather than once: fp32 rounding the bound covers)."""
        return self.fp8_x_hat @ self.w.w8_hat.T


def _check_w4(y, ref: torch.Tensor, x, w_hat, rounded: bool) -> str | None:
    return first_violation(y, ref, w4a16_bound(x, w_hat, ref, weights_rounded=rounded))


def _check_fp8(y, r: Reference, fast: bool) -> str | None:
    bound = fp8_bound(r.fp8_x_hat, r.w.w8_hat, r.fp8, r.x.dtype, mma=r.x.is_cuda,
                      fast_accum=fast)  # fmt: skip
    return first_violation(y, r.fp8, bound)


def candidates(fp8: bool) -> list[Candidate]:
    """Every candidate, ours and the baselines (FP8 ones only with FP8 tensor cores)."""

    def w4_bytes(w: Weights) -> int:
        return w.w4.nbytes

    out = [
        Candidate("torch_bf16", lambda x, w: (x, w.bf16), F.linear,
                  lambda y, r: _check_w4(y, r.bf16, r.x, r.w.bf16.float(), False),
                  lambda w: w.bf16.numel() * 2),
        Candidate("w4a16", lambda x, w: (x, w.w4), w4a16_linear,
                  lambda y, r: _check_w4(y, r.w4, r.x, r.w.w4_hat, r.x.shape[0] > 1), w4_bytes),
        Candidate("tinygemm", lambda x, w: (x, *w.tinygemm, w.w4.group_size), _tinygemm,
                  lambda y, r: _check_w4(y, r.tinygemm, r.x, r.tinygemm_w_hat, True), w4_bytes),
        Candidate("dequant_bf16", lambda x, w: (x, w.w4), _dequant_then_bf16,
                  lambda y, r: _check_w4(y, r.w4, r.x, r.w.w4_hat, True), w4_bytes),
    ]  # fmt: skip
    if not fp8:
        return out
    for fast in (False, True):
        tag = "_fast" if fast else ""

        def check(y, r, fast=fast):
            return _check_fp8(y, r, fast)

        def w8_bytes(w: Weights) -> int:
            return w.w8.nbytes

        def quantized(x, w):  # GEMM-only: the activations are quantized before timing
            return (*quantize_act_fp8(x), w.w8)

        out += [
            Candidate("fp8" + tag, lambda x, w: (x, w.w8),
                      lambda x, w8, f=fast: fp8_linear(x, w8, fast_accum=f), check, w8_bytes),
            Candidate("fp8_gemm" + tag, quantized,
                      lambda q, s, w8, f=fast: fp8_scaled_mm(q, s, w8, torch.bfloat16, f),
                      check, w8_bytes),
            Candidate("torch_scaled_mm" + tag, quantized,
                      lambda q, s, w8, f=fast: _scaled_mm(q, s, w8, f), check, w8_bytes),
            Candidate("torch_fp8" + tag, lambda x, w: (x, w.w8),
                      lambda x, w8, f=fast: _torch_fp8(x, w8, f), check, w8_bytes),
        ]  # fmt: skip
    return out
