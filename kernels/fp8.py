"""W8A8 FP8 (E4M3): fp8 weights, activations quantized on the fly, FP8 tensor cores at every M.

Both operands cross the bus in 8 bits and Hopper's tensor cores multiply E4M3 directly
(twice the bf16 rate), so prefill and large batches gain in bandwidth AND arithmetic.
Scales (qlab's absmax rule, s = amax / 448, a true fp32 division):

    weight      s_w per output channel (N,) or per tensor: pack_fp8, via qlab.quantize
    activation  s_x per token (row of x, M values) or per tensor, computed at run time

Pseudo-code:

    # 1. activations, ONE program per row, one pass (amax and quantize fused):
    #        s_x[m] = max_k |x[m, k]| / 448 ;  q_x[m, k] = e4m3(x[m, k] / s_x[m])  (RNE, saturating)
    # 2. GEMM over fp8 tiles, fp32 accumulator:
    acc = zeros(fp32)
    for k0 in range(0, K, BLOCK_K):
        acc = dot(q_w[n, k0:k0+BLOCK_K], q_x[m, k0:k0+BLOCK_K].T, acc)   # wgmma e4m3
    y[m, n] = acc * (s_x[m] * s_w[n])               # rescale ONCE, at the end

The rescale waits until the end because every term of the sum over k shares s_x[m] * s_w[n];
per-token and per-channel scales are free in the epilogue, per-group scales along K are not.

Small M (<= 128 tokens): swap-AB. Hopper's wgmma has a 64-row side (per warpgroup) and a
narrow side of 8..256; with 1..16 tokens on the 64-row side, 48+ rows of every MMA would
be padding. The kernel computes y^T = W x^T instead: output features on the 64-row side,
tokens on the narrow one, and split-K when the N tiles alone cannot fill the SMs.
Large M: tokens x features tiles in grouped (L2-swizzled) order.

Accumulation precision, a stated choice. Hopper's FP8 wgmma keeps a reduced-precision
internal sum (about 14 bits, DeepSeek-V3 report, sec. 3.3.2). fast_accum=False (default)
adds each BLOCK_K step's wgmma result into a separate full fp32 accumulator (Triton's
max_num_imprecise_acc = BLOCK_K), like torch._scaled_mm(use_fast_accum=False);
fast_accum=True lets the whole K loop accumulate inside wgmma (use_fast_accum=True).
The promotion reads the wgmma's registers in the same K step, so ptxas waits for every
wgmma in flight once per step (ptxas info C7517; tests/kernels/test_kernel_aot.py): the
precise mode drains the tensor cores every K step, the fast mode never.

NaN and inf in activations (NAN_POLICY, the same on a GPU and the interpreter): a row of x
holding any NaN or +-inf gets a NaN scale and NaN codes, so its outputs are NaN; the other
rows are untouched (per tensor: the one scale is NaN, so is every output). Never a finite
number: a GPU's max.f32 and min.f32 drop NaN, so without this a NaN activation would become
a finite code of +-448. qlab.quantize refuses such x (ValueError); a kernel cannot raise
without a host sync, so it returns NaN exactly where qlab has no answer.

Rounding to E4M3 (step 1) uses exact fp32 arithmetic (round_to_e4m3) and the final cast
only converts a value already on the E4M3 grid. On a GPU the cast alone would round
correctly (cvt.rn.satfinite), but Triton's CPU interpreter's cast rounds on the first
dropped bit only (not to even), can lose the carry into the exponent (1.9375 -> 1.0) and
does not saturate (notebook 08), and the codes must match qlab bit for bit on both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

import qlab
from qlab.kernels import configs
from qlab.kernels._backend import (
    INTERPRET,
    check_activation,
    check_device,
    check_linear_weight,
    needs_int64,
)
from qlab.kernels._tiles import split_k_buffers, store_or_reduce, tile_coords
from qlab.kernels.configs import Config, Launch

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
ONE_PASS_MAX_K = 8192  # rows up to this long stay in registers: x is read once
SWAP_AB_MAX_M = 128  # up to this many tokens the GEMM runs swap-AB
FP8_K_MULTIPLE = 16  # K of the GEMM: 16-byte row loads (other K are refused, not slowed)


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
    """fp32 -> the nearest E4M3 value (ties to even, saturating at +-448), still in fp32.
    NaN gives +-448 (minimum drops it): _quantize_row masks NaN rows by their NaN scale;
    a caller that does not mask gets +-448 for NaN."""
    a = tl.minimum(tl.abs(y), E4M3_MAX)  # saturate (qlab's default, like the OCP spec)
    # Biased fp32 exponent of a; below 2**-6 (E4M3 subnormals) the spacing stays 2**-9.
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    # E4M3 has 3 mantissa bits: in binade 2**(e-127) the spacing (quantum) is 2**(e-127-3).
    quantum = ((e - 3) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((257 - e) << 23).to(tl.float32, bitcast=True)  # 2**(130 - e), exact
    steps = (a * inv_quantum + ROUND_MAGIC) - ROUND_MAGIC  # a / quantum < 16, rounded RNE
    v = steps * quantum  # exact: back on the E4M3 grid
    # v >= 0 gets y's sign bit by an OR of the bits, so -0.0 stays -0.0 on every Triton:
    # with tl.where(negative, -v, v), Triton 3.6 on an H200 gave +0.0 where 3.9's
    # interpreter gives -0.0.
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_row(x, s):
    """fp32 values of one row and its scale -> E4M3 codes (qlab: x / s, a true division).
    A NaN scale (the row held a NaN or inf) gives NaN codes, on the GPU too, where min/max
    would turn NaN into a finite code."""
    s = tl.where(s == 0.0, 1.0, s)  # an all-zero row: divide by 1, codes of 0 (as qlab)
    q = round_to_e4m3(tl.div_rn(x, s))  # on the E4M3 grid, still fp32
    return tl.where(s == s, q, s)


@triton.jit
def _e4m3(v):
    """fp32 values on the E4M3 grid, or NaN -> float8e4nv, NaN as 0x7F on every backend
    (the interpreter's cast turns NaN into 0x7C, which is 256 + 128)."""
    bits = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(v == v, bits, 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _not_finite(x):
    """1 where x is NaN or +-inf, else 0 (a comparison: the same on a GPU and the interpreter,
    unlike max.f32, which on a GPU drops NaN)."""
    return tl.where(tl.abs(x) < float("inf"), 0, 1)


@triton.jit
def _act_quant_kernel(
    # pointers
    x_ptr,  # fp16/bf16/fp32 (M, K)
    q_ptr,  # fp8e4nv (M, K)
    s_ptr,  # fp32 (M,): written (MODE 0, 1), or one scale read (MODE 2)
    # sizes
    K,
    # strides
    stride_xm,
    stride_qm,
    # meta-parameters
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,  # K <= BLOCK_K: the row is loaded once and kept in registers
    MODE: tl.constexpr,  # 0: per token (scale + quantize), 1: scale only, 2: given scale
    INDEX_64: tl.constexpr,  # an element offset can pass 2**31 - 1: row offsets in int64
):
    """One program per row m: s[m] = max_k |x[m, k]| / 448 and/or q[m] = E4M3(x[m] / s)."""
    row = tl.program_id(0)
    if INDEX_64:
        row = row.to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        if MODE == 2:
            s = tl.load(s_ptr)
        else:
            s = tl.div_rn(tl.max(tl.abs(x), axis=0), E4M3_MAX)  # correctly rounded, as qlab
            s = tl.where(tl.max(_not_finite(x), axis=0) == 0, s, float("nan"))  # NAN_POLICY
            tl.store(s_ptr + row, s)
        if MODE != 1:
            tl.store(q_row + offs, _e4m3(_quantize_row(x, s)), mask=offs < K)
    else:
        if MODE == 2:
            s = tl.load(s_ptr)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            bad = tl.zeros((BLOCK_K,), dtype=tl.int32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
                bad = tl.maximum(bad, _not_finite(x))
            s = tl.div_rn(tl.max(amax, axis=0), E4M3_MAX)
            s = tl.where(tl.max(bad, axis=0) == 0, s, float("nan"))  # NAN_POLICY
            tl.store(s_ptr + row, s)
        if MODE != 1:
            for k0 in range(0, K, BLOCK_K):  # the second read of the row hits L2
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                q = _e4m3(_quantize_row(x, s))  # exact cast: on the grid
                tl.store(q_row + k0 + offs, q, mask=k0 + offs < K)


@triton.jit
def _fp8_gemm_swap_kernel(  # ~60 lines: half of them the argument list, Triton-tutorial style
    # pointers
    w_ptr,  # fp8e4nv (N, K): quantized weight, nn.Linear layout
    x_ptr,  # fp8e4nv (M, K): quantized activations
    sw_ptr,  # fp32 (N,) or (1,): weight scales
    sx_ptr,  # fp32 (M,) or (1,): activation scales
    out_ptr,  # fp16/bf16 (M, N)
    ws_ptr,  # fp32 split-K workspace
    count_ptr,  # int32 split-K counters
    # sizes
    M,
    N,
    K,
    # strides (0 for a per-tensor scale)
    stride_wn,
    stride_xm,
    stride_sw,
    stride_sx,
    stride_om,
    split_k,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # tokens: the narrow side of wgmma
    BLOCK_N: tl.constexpr,  # output features: the 64-row side
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,  # None: fast accumulation; BLOCK_K: promote every step
    INDEX_64: tl.constexpr,  # an element offset can pass 2**31 - 1: row offsets in int64
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1)  # clamped loads, masked stores
    tokens = tl.minimum(offs_m, M - 1)
    if INDEX_64:
        rows, tokens, offs_m = rows.to(tl.int64), tokens.to(tl.int64), offs_m.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    k_steps = tl.cdiv(K, BLOCK_K)
    k_start = pid_k * (k_steps // split_k) * BLOCK_K  # split_k divides k_steps
    k_end = tl.minimum(k_start + (k_steps // split_k) * BLOCK_K, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        in_k = k < K  # K need not be a multiple of BLOCK_K: zeros add nothing
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=in_k[None, :], other=0.0)
        # x^T tile, K contiguous (K-major, as fp8 wgmma requires): shape (BLOCK_K, BLOCK_M)
        x_t = tl.load(x_ptr + tokens[None, :] * stride_xm + k[:, None], mask=in_k[:, None],
                      other=0.0)  # fmt: skip
        acc = tl.dot(w, x_t, acc, max_num_imprecise_acc=MAX_IMPRECISE)

    # Epilogue: the only place the scales appear (before a split-K sum: it is linear).
    s_w = tl.load(sw_ptr + rows * stride_sw)
    s_x = tl.load(sx_ptr + tokens * stride_sx)
    acc = acc * (s_w[:, None] * s_x[None, :])
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    out_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    store_or_reduce(
        acc, out_ptrs, out_mask, ws_ptr, count_ptr, local,
        tile, num_m * num_n, pid_k, split_k, TILE=BLOCK_N * BLOCK_M,
    )  # fmt: skip


@triton.jit
def _fp8_gemm_kernel(
    # pointers
    x_ptr,  # fp8e4nv (M, K): quantized activations
    w_ptr,  # fp8e4nv (N, K): quantized weight, nn.Linear layout
    sx_ptr,  # fp32 (M,) or (1,)
    sw_ptr,  # fp32 (N,) or (1,)
    out_ptr,  # fp16/bf16 (M, N)
    # sizes
    M,
    N,
    K,
    # strides (0 for a per-tensor scale)
    stride_xm,
    stride_wn,
    stride_sx,
    stride_sw,
    stride_om,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # grouped tile order: GROUP_M row tiles share W tiles in L2
    NUM_STAGES: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
    INDEX_64: tl.constexpr,  # an element offset can pass 2**31 - 1: row offsets in int64
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(tl.program_id(0), num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.minimum(offs_m, M - 1)
    rows = tl.minimum(offs_n, N - 1)
    if INDEX_64:
        rows, tokens, offs_m = rows.to(tl.int64), tokens.to(tl.int64), offs_m.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        in_k = k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + k[None, :], mask=in_k[None, :],
                    other=0.0)  # fmt: skip
        # W^T tile, K contiguous: shape (BLOCK_K, BLOCK_N)
        w_t = tl.load(w_ptr + rows[None, :] * stride_wn + k[:, None], mask=in_k[:, None],
                      other=0.0)  # fmt: skip
        acc = tl.dot(x, w_t, acc, max_num_imprecise_acc=MAX_IMPRECISE)

    s_x = tl.load(sx_ptr + tokens * stride_sx)
    s_w = tl.load(sw_ptr + rows * stride_sw)
    out = acc * (s_x[:, None] * s_w[None, :])
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )


# ----------------------------------------------------------------------------- wrappers
def check_fp8_weight(w) -> None:
    """An FP8Weight as pack_fp8 makes it: E4M3 codes (N, K) with K a multiple of 16 and
    unit stride along K, float32 scales (N,) per channel or (1,) per tensor."""
    if not isinstance(w, FP8Weight):
        raise TypeError(f"w must be the FP8Weight from pack_fp8, got {type(w).__name__}")
    codes, scales = w.codes, w.scales
    if codes.dtype != torch.float8_e4m3fn or codes.ndim != 2 or codes.stride(-1) != 1:
        raise ValueError(
            f"w.codes must be float8_e4m3fn (N, K) with unit stride along K, got {codes.dtype} "
            f"of shape {tuple(codes.shape)}; build it with pack_fp8"
        )
    N, K = codes.shape
    if K % FP8_K_MULTIPLE:
        raise ValueError(
            f"in_features K = {K} is not a multiple of {FP8_K_MULTIPLE}: the FP8 GEMM loads "
            f"16 bytes of a row at a time; pad the weight and x with zero columns to "
            f"K = {-(-K // FP8_K_MULTIPLE) * FP8_K_MULTIPLE} (zeros add nothing to the products)"
        )
    want = {"channel": (N,), "tensor": (1,)}.get(w.granularity)
    if want is None:
        raise ValueError(f"w.granularity must be 'channel' or 'tensor', got {w.granularity!r}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(
            f"w.scales must be float32, got {getattr(scales, 'dtype', type(scales).__name__)}: "
            "the kernel reads them as fp32 bits; convert with .float()"
        )
    if tuple(scales.shape) != want or not scales.is_contiguous():
        raise ValueError(
            f"w.scales must be contiguous of shape {want} for {w.granularity!r} granularity "
            f"and N = {N}, got {tuple(scales.shape)}"
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
    "fp8_e4m3", granularity) (on the CPU; the result is on weight's device); granularity
    "channel" (one scale per output row) or "tensor".
    """
    check_linear_weight(weight)
    if granularity not in ("channel", "tensor"):
        raise ValueError(
            f"granularity must be 'channel' or 'tensor' for the FP8 kernel, got "
            f"{granularity!r} (per-group scales along K cannot be applied once at the end)"
        )
    qt = qlab.quantize(weight.detach().cpu(), "fp8_e4m3", granularity)  # uint8 codes, fp32
    codes = qt.codes.view(torch.float8_e4m3fn)  # same bits, a dtype tl.dot understands
    scales = qt.scales.reshape(-1).to(torch.float32)  # (N,) or (1,)
    return FP8Weight(
        codes=codes.contiguous().to(weight.device),
        scales=scales.contiguous().to(weight.device),
        granularity=granularity,
    )


def plan_act_quant(x, codes, scales, mode: int) -> Launch:
    """The launch quantizing x (M, K): mode 0 per token, 1 row scales only, 2 with scales[0]."""
    M, K = x.shape
    one_pass = K <= ONE_PASS_MAX_K
    block_k = triton.next_power_of_2(K) if one_pass else 2048
    return Launch(
        kernel=_act_quant_kernel,
        grid=(M,),
        args=(x, codes, scales, K, x.stride(0), codes.stride(0)),
        meta=dict(BLOCK_K=block_k, ONE_PASS=one_pass, MODE=mode, INDEX_64=needs_int64(x, codes),
                  num_warps=4 if block_k <= 2048 else 8 if block_k <= 4096 else 16),  # fmt: skip
    )


def quantize_act_fp8(
    x: torch.Tensor, granularity: str = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations x (M, K) to E4M3 at run time.

    Per token: ONE kernel, one program per row (amax and quantize fused). Per tensor: the
    row amaxes, their max (torch), then the quantize pass: a global max needs every row.
    Returns (codes float8_e4m3fn (M, K), scales float32: (M,) per token or () per tensor),
    bit-exact with qlab.quantize(x, "fp8_e4m3", "channel" | "tensor").
    """
    if granularity not in ("token", "tensor"):
        raise ValueError(f"act granularity must be 'token' or 'tensor', got {granularity!r}")
    check_activation(x, dtypes=(torch.float16, torch.bfloat16, torch.float32), two_d=True)
    check_device(x)
    M, K = x.shape
    codes = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    row_scales = torch.zeros((M,), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return codes, row_scales if granularity == "token" else row_scales.new_zeros(())
    if granularity == "token":
        plan_act_quant(x, codes, row_scales, mode=0)()
        return codes, row_scales
    plan_act_quant(x, codes, row_scales, mode=1)()
    # Division by 448 is monotonic, so max_m(amax_m / 448) == amax(x) / 448 exactly.
    scale = row_scales.amax()
    plan_act_quant(x, codes, scale.reshape(1), mode=2)()
    return codes, scale


def plan_gemm(q_x, s_x, w: FP8Weight, out, config: Config, sms: int, fast_accum: bool,
              buffers=split_k_buffers) -> Launch:  # fmt: skip
    """The GEMM launch of fp8_scaled_mm with `config` (what compile_for builds)."""
    M, K = q_x.shape
    N = w.shape[0]
    stride_sx = 1 if s_x.ndim == 1 else 0  # per token, or one scale broadcast with stride 0
    stride_sw = 1 if w.granularity == "channel" else 0
    max_imprecise = None if fast_accum else config.block_k
    index_64 = needs_int64(q_x, w.codes, out)
    if M <= SWAP_AB_MAX_M:
        tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
        split = configs.split_k_for(tiles, triton.cdiv(K, config.block_k), sms)
        ws, counts = buffers(split, tiles, config.block_m * config.block_n, out.device)
        return Launch(
            kernel=_fp8_gemm_swap_kernel,
            grid=(tiles, split),
            args=(w.codes, q_x, w.scales, s_x, out, ws, counts, M, N, K,
                  w.codes.stride(0), q_x.stride(0), stride_sw, stride_sx, out.stride(0),
                  split),  # fmt: skip
            meta=dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      GROUP_M=config.group_m, NUM_STAGES=config.num_stages, INDEX_64=index_64,
                      MAX_IMPRECISE=max_imprecise, num_warps=config.num_warps),  # fmt: skip
            config=config,
        )
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    return Launch(
        kernel=_fp8_gemm_kernel,
        grid=(tiles,),
        args=(q_x, w.codes, s_x, w.scales, out, M, N, K,
              q_x.stride(0), w.codes.stride(0), stride_sx, stride_sw, out.stride(0)),  # fmt: skip
        meta=dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  GROUP_M=config.group_m, NUM_STAGES=config.num_stages, INDEX_64=index_64,
                  MAX_IMPRECISE=max_imprecise, num_warps=config.num_warps),  # fmt: skip
        config=config,
    )


def fp8_scaled_mm(
    q_x: torch.Tensor,
    s_x: torch.Tensor,
    w: FP8Weight,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """The GEMM alone: (q_x (M, K) fp8, s_x (M,) or ()) from quantize_act_fp8, times
    W_hat.T -> (M, N) in out_dtype. What torch._scaled_mm does (use_fast_accum=fast_accum);
    fp8_linear calls it."""
    check_fp8_weight(w)
    check_activation(q_x, w.shape[1], dtypes=(torch.float8_e4m3fn,), two_d=True)
    M, K = q_x.shape
    N = w.shape[0]
    if not isinstance(s_x, torch.Tensor) or s_x.dtype != torch.float32:
        raise TypeError(
            f"s_x must be a float32 tensor (the scales quantize_act_fp8 returns), got "
            f"{getattr(s_x, 'dtype', type(s_x).__name__)}; other dtypes would be read as fp32 bits"
        )
    if tuple(s_x.shape) not in ((M,), ()):
        raise ValueError(f"s_x must be float32 of shape ({M},) or (), got {tuple(s_x.shape)}")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    check_device(q_x, s_x, w.codes)
    _check_fp8_device(q_x)
    out = torch.empty((M, N), dtype=out_dtype, device=q_x.device)
    if M == 0 or N == 0:
        return out
    sms = configs.device_sms()
    key = (N, K, str(out_dtype), bool(fast_accum))

    def launch(c: Config) -> Launch:
        return plan_gemm(q_x, s_x, w, out, c, sms, fast_accum)

    config = configs.choose("fp8", M, key, lambda c: launch(c)())
    launch(config)()
    return out


def fp8_linear(
    x: torch.Tensor, w: FP8Weight, act_granularity: str = "token", fast_accum: bool = False
) -> torch.Tensor:
    """y = x @ W_hat.T with activations quantized to E4M3 on the fly (per token or
    per tensor), an FP8 tensor-core dot, fp32 accumulation and one rescale at the end.

    x: (..., K) float16 or bfloat16; returns (..., N) in x's dtype. Needs sm_89+ on a GPU.
    fast_accum: let the FP8 MMA accumulate the whole K loop at its internal precision
    (see the module docstring); False promotes into fp32 every K step.
    """
    check_fp8_weight(w)
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
    y = fp8_scaled_mm(q_x, s_x, w, x.dtype, fast_accum)
    return y.reshape(*x.shape[:-1], N)
