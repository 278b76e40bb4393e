"""W4A16: int4 weights with group scales, 16-bit activations, fp32 accumulation.

Weight-only quantization (GPTQ, AWQ, most GGUF files): the packed 4-bit weights are what
crosses the memory bus, 16 / 4.125 = 3.88x fewer bytes than bf16 at group 128; they are
unpacked and scaled inside the kernel and the arithmetic stays 16-bit.

Layout (pack_w4a16, W4A16Weight.from_qtensor): the nn.Linear weight W (N = out_features,
K = in_features) as qlab.quantize(W, "int4", g) gives it, packed by qlab.pack_int4:
packed[n, k // 2] holds code[n, k] (even k in the low nibble), scales[n, k // g] fp16.
Nothing is reordered: row n of `packed` is row n of W, K runs along the bytes.

Decode, M = 1 (the GEMV, CUDA cores; one program = block_n rows x one K range):

    for k0 in my K range, step block_k (<= g, so one scale per row per step):  # pipelined
        bytes = packed[rows, k0/2 : (k0 + block_k)/2]     # 16 contiguous bytes per thread
        lo, hi = low / high nibbles as exact fp32          # magic number, no int->float op
        acc += (lo * x[k0 + 2j] + hi * x[k0 + 2j + 1]) * s[rows]
    y[rows] = sum(acc)            # or: reduce split_k partial sums (kernels/_tiles.py)

Batches, M > 1 (the GEMM, tensor cores, swap-AB): compute y^T = W_hat x^T so the output
features sit on the 64-row side of Hopper's wgmma and the few tokens on its narrow side:

    for k0 ...:                                             # pipelined: cp.async stages
        w = fp16/bf16(code[rows, k0:k0+block_k] * s[rows])  # dequantized tile, registers
        acc += dot(w, x[tokens, k0:k0+block_k]^T)           # wgmma, A from registers
                                                            # (put there via shared memory)
    y[tokens, rows] = acc^T

The scale multiplies the weight tile before the dot (block_n x block_k multiplies per step)
rather than the accumulator after it: scaling the accumulator would need the dot's result
every step and stall the tensor-core pipeline (wgmma.wait_group 0). The price is one
rounding of c * s to 16 bits per weight (the tolerance, kernels/tolerance.py, counts it).

int4 -> float without an int-to-float instruction (still several SASS instructions per
nibble: the GEMV's main loop issues about 16 per packed byte, notebook 09, which makes it
instruction-bound rather than bandwidth-bound by the model): XOR-ing a nibble with 8 gives
code + 8 (4-bit two's complement to offset binary); placed in the mantissa of 2**23 (fp32) or 1024
(fp16) it reads as 2**23 + code + 8, and one subtraction leaves the exact code:
    fp32(0x4B000000 | (nib ^ 8)) - (2**23 + 8) == code
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

__all__ = ["W4A16Weight", "pack_w4a16", "w4a16_linear"]

MIN_BLOCK_K = 16  # tl.dot's smallest K tile; every group size must be a multiple of it
# Globals a kernel reads must be tl.constexpr.
MAGIC_F32 = tl.constexpr(0x4B000008)  # bits of fp32 2**23, plus the 8 (see the docstring)
MAGIC_F32_VALUE = tl.constexpr(8388616.0)  # 2**23 + 8
MAGIC_F16 = tl.constexpr(0x6408)  # bits of fp16 1024.0, plus 8
MAGIC_F16_VALUE = tl.constexpr(1032.0)  # 1024 + 8


class W4A16Weight(NamedTuple):
    """A packed W4A16 weight: exactly what the kernels read."""

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

    @classmethod
    def from_qtensor(cls, qt: qlab.QTensor) -> W4A16Weight:
        """Pack an int4 QTensor (qlab.quantize(W, "int4", g), or GPTQ's) for the kernels.

        qt: scheme "int4" (symmetric), codes int8 (N, K) in -8..7, scales float16 (N, K // g),
        granularity an int g that divides K and is a multiple of 16.
        """
        if not isinstance(qt, qlab.QTensor) or qt.scheme.name != "int4":
            name = getattr(getattr(qt, "scheme", None), "name", type(qt).__name__)
            raise TypeError(f"from_qtensor needs a QTensor of scheme 'int4', got {name}")
        if qt.zero_points is not None:
            raise ValueError("the W4A16 kernels take symmetric int4 (no zero points)")
        if qt.codes.ndim != 2:
            raise ValueError(f"codes must be 2-D (N, K) like nn.Linear, got {tuple(qt.shape)}")
        g = qt.granularity
        if isinstance(g, bool) or not isinstance(g, int):
            raise ValueError(
                f"granularity must be an int group size along K, got {g!r}; quantize with "
                "qlab.quantize(W, 'int4', group_size)"
            )
        _check_group(g, qt.codes.shape[1])
        if qt.scales.dtype != torch.float16:
            raise TypeError(f"scales must be float16 (qlab's int4 scales), got {qt.scales.dtype}")
        packed = qlab.pack_int4(qt.codes)  # shape: (N, K // 2) uint8, raises outside -8..15
        return cls(
            packed=packed.contiguous(),
            scales=qt.scales.contiguous(),
            group_size=g,
            shape=tuple(qt.codes.shape),
        )


def _check_group(group_size, k: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if group_size % MIN_BLOCK_K:
        raise ValueError(
            f"group_size {group_size} is not a multiple of {MIN_BLOCK_K}: a K step of the "
            "kernel never straddles two groups and tl.dot needs steps of 16; use 32, 64 or 128"
        )
    if k % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide in_features K = {k}; "
            "pad the weight or pick a divisor"
        )


def pack_w4a16(weight: torch.Tensor, group_size: int = 128) -> W4A16Weight:
    """Quantize an nn.Linear weight (N, K) to int4 with group scales and pack it.

    = W4A16Weight.from_qtensor(qlab.quantize(weight, "int4", group_size)), quantized on the
    CPU and returned on weight's device.
    group_size must divide K and be a multiple of 16.
    """
    check_linear_weight(weight)
    _check_group(group_size, weight.shape[1])
    # qlab quantizes on the CPU (where it is tested against its references); the packed
    # bytes and scales then move to the weight's device.
    qt = qlab.quantize(weight.detach().cpu(), "int4", group_size)  # int8 (N, K), fp16 scales
    w = W4A16Weight.from_qtensor(qt)
    return w._replace(packed=w.packed.to(weight.device), scales=w.scales.to(weight.device))


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _nibbles_f32(b):
    """int32 tile of packed bytes (0..255) -> (low, high) nibbles as exact fp32 codes."""
    lo = ((b & 0xF) ^ MAGIC_F32).to(tl.float32, bitcast=True) - MAGIC_F32_VALUE
    hi = ((b >> 4) ^ MAGIC_F32).to(tl.float32, bitcast=True) - MAGIC_F32_VALUE
    return lo, hi


@triton.jit
def _dequant_tile(b, s, x_ptr):
    """Packed bytes (R, C) uint8 and scales (R,) fp16 -> w_hat (R, 2C) in x's dtype:
    the 16-bit rounding of code * s, columns in k order (even k from the low nibble)."""
    b = b.to(tl.int32)
    if x_ptr.dtype.element_ty == tl.float16:
        # fp16 magic: 1024 + code + 8, exact; then one fp16 multiply (correctly rounded).
        lo = ((b & 0xF) ^ MAGIC_F16).to(tl.int16).to(tl.float16, bitcast=True) - MAGIC_F16_VALUE
        hi = ((b >> 4) ^ MAGIC_F16).to(tl.int16).to(tl.float16, bitcast=True) - MAGIC_F16_VALUE
        return tl.interleave(lo, hi) * s[:, None]
    else:
        # bf16: code * s is exact in fp32 (4-bit code, fp16 scale); round once to bf16.
        lo, hi = _nibbles_f32(b)
        w = tl.interleave(lo, hi) * s.to(tl.float32)[:, None]
        return w.to(x_ptr.dtype.element_ty)


@triton.jit
def _x_pairs_f32(pairs, x_ptr):
    """int32 words holding (x[2j], x[2j+1]) -> the two halves as fp32 (even, odd)."""
    if x_ptr.dtype.element_ty == tl.bfloat16:
        # bf16 is the top half of an fp32: shifting the bits into place is the conversion.
        return (pairs << 16).to(tl.float32, bitcast=True), (pairs & -65536).to(
            tl.float32, bitcast=True
        )
    else:
        even = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return even, odd


@triton.jit
def _w4a16_gemv_kernel(
    # pointers
    x_ptr,  # fp16/bf16 (K,), 16-byte aligned
    packed_ptr,  # uint8 (N, K // 2)
    scales_ptr,  # fp16 (N, K // GROUP_SIZE)
    out_ptr,  # x's dtype (N,)
    ws_ptr,  # fp32 split-K workspace
    count_ptr,  # int32 split-K counters
    # sizes
    N,
    K,
    # strides
    stride_pn,
    stride_sn,
    # split-K: programs per row block, each summing K // split_k
    split_k,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE: one scale per row per step
    NUM_STAGES: tl.constexpr,
    INDEX_64: tl.constexpr,  # an element offset can pass 2**31 - 1: row offsets in int64
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # shape: (BLOCK_N,)
    # Clamp instead of masking the loads: a mask would not stop a ragged last block from
    # reading, and unmasked 16-byte loads stay whole. Only the store is masked.
    rows = tl.minimum(offs_n, N - 1)
    if INDEX_64:
        rows = rows.to(tl.int64)
    offs_b = tl.arange(0, BLOCK_K // 2)  # byte j of a step holds k0 + 2j and k0 + 2j + 1
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # word j = (x[2j], x[2j+1])

    k_len = K // split_k
    k_start = tl.multiple_of(pid_k * k_len, BLOCK_K)
    s_ptrs = scales_ptr + rows * stride_sn
    s = tl.load(s_ptrs + k_start // GROUP_SIZE)  # shape: (BLOCK_N,) fp16
    acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)  # summed across threads once
    for k0 in tl.range(k_start, k_start + k_len, BLOCK_K, num_stages=NUM_STAGES):
        # The next step's scales now, so their latency hides behind this step.
        s_next = tl.load(s_ptrs + tl.minimum(k0 + BLOCK_K, K - 1) // GROUP_SIZE)
        b = tl.load(packed_ptr + rows[:, None] * stride_pn + (k0 // 2 + offs_b)[None, :])
        x_even, x_odd = _x_pairs_f32(tl.load(x_pairs + k0 // 2 + offs_b), x_ptr)
        lo, hi = _nibbles_f32(b.to(tl.int32))  # shape: (BLOCK_N, BLOCK_K // 2) each
        # x * code is exact in fp32; one scale per row for the whole step.
        acc += (lo * x_even[None, :] + hi * x_odd[None, :]) * s.to(tl.float32)[:, None]
        s = s_next

    y = tl.sum(acc, axis=1)  # shape: (BLOCK_N,)
    store_or_reduce(
        y, out_ptr + offs_n, offs_n < N, ws_ptr, count_ptr, tl.arange(0, BLOCK_N),
        pid_n, tl.num_programs(0), pid_k, split_k, TILE=BLOCK_N,
    )  # fmt: skip


# split_k is never compiled in as a constant: Triton specializes an int argument equal to 1,
# and with split_k == 1 built in, ptxas serialises every wgmma of the K loop (ptxas info
# C7515, a WARPGROUP.DEPBAR wait after each HGMMA: tests/kernels/test_kernel_aot.py).
@triton.jit(do_not_specialize=["split_k"])
def _w4a16_gemm_kernel(  # ~60 lines: half of them the argument list, Triton-tutorial style
    # pointers
    x_ptr,  # fp16/bf16 (M, K)
    packed_ptr,  # uint8 (N, K // 2)
    scales_ptr,  # fp16 (N, K // GROUP_SIZE)
    out_ptr,  # x's dtype (M, N)
    ws_ptr,  # fp32 split-K workspace
    count_ptr,  # int32 split-K counters
    # sizes
    M,
    N,
    K,
    # strides (the last axis of every tensor is contiguous)
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    split_k,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tokens: the narrow side of the MMA
    BLOCK_N: tl.constexpr,  # output features: the 64-row side of wgmma
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter only: its tl.dot mishandles bf16
    INDEX_64: tl.constexpr,  # an element offset can pass 2**31 - 1: row offsets in int64
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # shape: (BLOCK_N,)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # shape: (BLOCK_M,)
    rows = tl.minimum(offs_n, N - 1)  # clamped loads, masked stores (see the GEMV)
    tokens = tl.minimum(offs_m, M - 1)
    if INDEX_64:
        rows, tokens, offs_m = rows.to(tl.int64), tokens.to(tl.int64), offs_m.to(tl.int64)
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_k = tl.arange(0, BLOCK_K)

    k_len = K // split_k
    k_start = tl.multiple_of(pid_k * k_len, BLOCK_K)
    s_ptrs = scales_ptr + rows * stride_sn
    s = tl.load(s_ptrs + k_start // GROUP_SIZE)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile
    for k0 in tl.range(k_start, k_start + k_len, BLOCK_K, num_stages=NUM_STAGES):
        s_next = tl.load(s_ptrs + tl.minimum(k0 + BLOCK_K, K - 1) // GROUP_SIZE)
        b = tl.load(packed_ptr + rows[:, None] * stride_pn + (k0 // 2 + offs_b)[None, :])
        # x^T tile, K contiguous: shape (BLOCK_K, BLOCK_M)
        x_t = tl.load(x_ptr + tokens[None, :] * stride_xm + (k0 + offs_k)[:, None])
        w = _dequant_tile(b, s, x_ptr)  # shape: (BLOCK_N, BLOCK_K), x's dtype
        if UPCAST_DOT:
            acc = tl.dot(w.to(tl.float32), x_t.to(tl.float32), acc)  # same exact products
        else:
            acc = tl.dot(w, x_t, acc)  # 16-bit tensor cores, fp32 accumulator
        s = s_next

    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]  # y[m, n] = acc[n, m]
    out_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    store_or_reduce(
        acc, out_ptrs, out_mask, ws_ptr, count_ptr, local,
        tile, num_m * num_n, pid_k, split_k, TILE=BLOCK_N * BLOCK_M,
    )  # fmt: skip


# ----------------------------------------------------------------------------- wrapper
def _block_k(config: Config, group_size: int) -> int:
    """The config's K step, shrunk to divide the group (one scale per row per step)."""
    block_k = config.block_k
    while group_size % block_k:
        block_k //= 2
    return block_k


def plan(x2, w: W4A16Weight, out, config: Config, sms: int, buffers=split_k_buffers) -> Launch:
    """The one launch w4a16_linear makes for x2 (M, K) with `config` (also what
    qlab.kernels.compile_for builds). M = 1 takes the GEMV, larger M the swap-AB GEMM."""
    M, K = x2.shape
    N = w.shape[0]
    g = w.group_size
    block_k = _block_k(config, g)
    k_steps = K // block_k
    if M == 1:
        tiles = triton.cdiv(N, config.block_n)
        split = configs.split_k_for(tiles, k_steps, sms)
        ws, counts = buffers(split, tiles, config.block_n, out.device)
        return Launch(
            kernel=_w4a16_gemv_kernel,
            grid=(tiles, split),
            args=(x2, w.packed, w.scales, out, ws, counts, N, K,
                  w.packed.stride(0), w.scales.stride(0), split),  # fmt: skip
            meta=dict(GROUP_SIZE=g, BLOCK_N=config.block_n, BLOCK_K=block_k,
                      NUM_STAGES=config.num_stages, INDEX_64=needs_int64(w.packed),
                      num_warps=config.num_warps),  # fmt: skip
            config=config,
        )
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    split = configs.split_k_for(tiles, k_steps, sms)
    ws, counts = buffers(split, tiles, config.block_m * config.block_n, out.device)
    return Launch(
        kernel=_w4a16_gemm_kernel,
        grid=(tiles, split),
        args=(x2, w.packed, w.scales, out, ws, counts, M, N, K, x2.stride(0),
              w.packed.stride(0), w.scales.stride(0), out.stride(0), split),  # fmt: skip
        meta=dict(
            GROUP_SIZE=g, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
            GROUP_M=config.group_m, NUM_STAGES=config.num_stages,
            # Triton's CPU interpreter feeds bf16 to numpy as raw uint16 in tl.dot;
            # upcasting to fp32 there gives the same exact products and fp32 sums.
            UPCAST_DOT=INTERPRET and x2.dtype == torch.bfloat16,
            INDEX_64=needs_int64(x2, w.packed, out),
            num_warps=config.num_warps,
        ),  # fmt: skip
        config=config,
    )


def w4a16_linear(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """y = x @ W_hat.T for x (..., K) in fp16/bf16; returns (..., N) in x's dtype.

    W_hat = qlab.dequantize(qlab.quantize(W, "int4", group_size)); accumulation is fp32.
    M = 1 (one token) takes the GEMV kernel, larger M the tensor-core GEMM; the launch
    config comes from qlab.kernels.configs (timed on a GPU, see configs.chosen()).
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
    if x2.data_ptr() % 16:  # the GEMV reads x as 32-bit words; keep every load aligned
        x2 = x2.clone()
    sms = configs.device_sms()
    key = (N, K, w.group_size, str(x.dtype))
    config = configs.choose("w4a16", M, key, lambda c: plan(x2, w, out, c, sms)())
    plan(x2, w, out, config, sms)()
    return out.reshape(*x.shape[:-1], N)
