"""W4A16: int4 weights with group scales, 16-bit activations, fp32 accumulation.

Weight-only quantization (GPTQ, AWQ checkpoints): the packed 4-bit weights are what
crosses the memory bus, 16 / 4.125 = 3.88x fewer bytes than bf16 at group 128; they are
unpacked and scaled inside the kernel and the arithmetic stays 16-bit.

Layout (pack_w4a16, W4A16Weight.from_qtensor): the nn.Linear weight W (N = out_features,
K = in_features) as qlab.quantize(W, "int4", g) gives it, packed by qlab.pack_int4:
packed[n, k // 2] holds code[n, k] (even k in the low nibble), scales[n, k // g] fp16.
Nothing is reordered: row n of `packed` is row n of W, K runs along the bytes. When K is a
multiple of 128 and g is 32, 64 or a multiple of 128 (groups_per_step), the same codes are
also kept in the decode layout (`words`, pack_int4_mma): reordered so that each 32-bit word
a thread loads is one mma.sync A fragment.

Decode, M = 1, with the decode layout (the GEMV on tensor cores; one warp = 32 rows, one
program = block_n rows x one K range; thread lane = 4r + q; g a multiple of 128 below,
g = 64 and 32 after it):

    for k0 in my K range, step 128:                # no shared memory, no barrier
        words = 16 int32 (4 x 16-byte loads): rows r, r+8, r+16, r+24, k0+32q .. k0+32q+31
        xs = x[k0 + 32q : k0 + 32q + 32]           # the same K for every row: the B operand
        for each of 16 words: 4 LOP3 (+ shifts) and 4 HADD2/HFMA2 -> four 16-bit pairs
            (bf16: 0x4300 | n = 128 + n, minus 136; fp16: 0x6400 | n = 1024 + n, minus
            1032, or the high nibble in place, 0x6400 | 16 n = 1024 + 16 n, times 1/16
            minus 72: the exact code),
            one mma.sync.m16n8k16 (x in all 8 columns of B: every column is the dot)
        acc[my rows] += mma_sum * s[my rows, k0 // g]  # fp32, once per row per step
    y[rows] = acc             # or: reduce split_k partial sums (kernels/_tiles.py)

At g = 64 and 32 a step holds GPS = 128 / g groups, and K is permuted inside a step so that
every mma's 16 k lie in one group. Column n of B carries x only in the mmas of group
n * GPS // 8 (masked loads give zeros in the others), so the sums a thread holds (D columns
2q, 2q + 1) are those of group q * GPS // 4 alone: it scales them by s[rows, k0 // g +
q * GPS // 4], and after the loop the lanes q of a row add their groups' sums, each group
once (the lanes with q % (4 / GPS) == 0).

The tensor cores do the multiply-adds, so the loop issues about 3.1 (fp16) or 3.6 (bf16)
SASS instructions per weight byte (tests/kernels/test_w4a16_decode.py): below the 9.2 and
6.4 thread-instructions an H100 SXM and an H200 issue per byte of HBM bandwidth
(roofline.issue_rate); at g = 64 and 32, 3.3 (fp16) and 3.8 (bf16). Without the decode
layout (K not a multiple of 128, e.g. TinyLM's 192; g = 16, 48, ...) the plain GEMV runs on
`packed` (CUDA cores, about 19.6 instructions per byte at g = 64 on TinyLM's 768 x 192): per
step of block_k <= g,
acc += (lo * x[k0 + 2j] + hi * x[k0 + 2j + 1]) * s[rows] with lo, hi exact fp32 nibbles.

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

int4 -> float without an int-to-float instruction (in the plain GEMV and the GEMM still
several SASS instructions per nibble: the plain GEMV issues about 19.6 per packed byte at
g = 64 (768 x 192), which makes its K loop instruction-bound rather than bandwidth-bound
by the model): XOR-ing a nibble with 8 gives code + 8 (4-bit two's complement to offset binary);
placed in the mantissa of 2**23 (fp32) or 1024 (fp16) it reads as 2**23 + code + 8, and one
subtraction leaves the exact code:
    fp32(0x4B000000 | (nib ^ 8)) - (2**23 + 8) == code
"""

from __future__ import annotations

from dataclasses import replace
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
    # int32 (ceil(N / 32), 4 K): the same codes in the decode layout (pack_int4_mma) that
    # the tensor-core GEMV reads, in group_size's step order (not checked: words packed for a
    # group with another order, 32, 64 or a multiple of 128, give wrong results); None where
    # groups_per_step(group_size, K) is None
    words: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for the weight: packed codes + scales (the decode layout
        holds the same codes, plus rows of code 0 up to a multiple of 32 rows)."""
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
        k = qt.codes.shape[1]
        _check_group(g, k)
        if qt.scales.dtype != torch.float16:
            raise TypeError(f"scales must be float16 (qlab's int4 scales), got {qt.scales.dtype}")
        packed = qlab.pack_int4(qt.codes)  # shape: (N, K // 2) uint8, raises outside -8..15
        return cls(
            packed=packed.contiguous(),
            scales=qt.scales.contiguous(),
            group_size=g,
            shape=tuple(qt.codes.shape),
            words=pack_int4_mma(qt.codes, group_size=g) if groups_per_step(g, k) else None,
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
    words = None if w.words is None else w.words.to(weight.device)
    return w._replace(packed=w.packed.to(weight.device), scales=w.scales.to(weight.device),
                      words=words)  # fmt: skip


# ----------------------------------------------------------------------------- decode layout
MMA_ROWS = 32  # weight rows per tile of the decode layout: two 16-row mma.sync blocks
MMA_K = 128  # K per step of the decode layout: one scale group at g = 128
_MMA_ROWS, _MMA_K = tl.constexpr(MMA_ROWS), tl.constexpr(MMA_K)  # the same, for kernels


def groups_per_step(group_size: int, k: int) -> int | None:
    """Scale groups in one 128-wide K step of the decode layout: 1 for a group that is a
    multiple of 128, 2 at g = 64, 4 at g = 32; None where the layout does not apply (K not a
    multiple of 128, or any other group: 16, 48, 80, 96, 112, 144, ...; those take the plain
    GEMV)."""
    if k % MMA_K:
        return None
    if group_size % MMA_K == 0:
        return 1
    return MMA_K // group_size if group_size in (32, 64) else None


def _step_order(group_size: int, k: int) -> torch.Tensor:
    """The k order pack_int4_mma lays out: position 128S + 32q + i (thread q's share of step
    S, in the g = 128 layout) holds k = 128S + w t + (w / 4) q + i % (w / 4), with t =
    i // (w / 4) and w = 128 / groups_per_step the k of one group inside a step: every
    mma.sync's 16 k lie in one group, so its sum can take that group's scale. The identity
    for g a multiple of 128."""
    gps = groups_per_step(group_size, k)
    if gps is None:
        raise ValueError(
            f"the decode layout needs K a multiple of {MMA_K} and a group of 32, 64 or a "
            f"multiple of {MMA_K}, got K = {k}, group_size = {group_size}"
        )
    order = torch.arange(k).reshape(k // MMA_K, gps, 4, MMA_K // gps // 4)  # (S, t, q, i)
    return order.transpose(1, 2).reshape(k)


def pack_int4_mma(codes: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """int4 codes (N, K) in -8..7 -> int32 words (ceil(N / 32), 4 * K): the decode layout.

    The GEMV's tensor-core path reads it: each thread loads its words with 16-byte loads,
    and every word already holds the eight nibbles one mma.sync.m16n8k16 A fragment wants,
    in the order the LOP3 magic-number conversion wants. Word w of tile T (rows 32T..32T+31)
    at step S (k = 128S..128S+127), w = 512S + 128c + 4 lane + v, with lane = 4r + q,
    c = 2b + j // 4 and j = 4 (c % 2) + v, holds in bits 4p..4p+3 (p = rs + 2 e_hi + 4 e_lo)

        code[32T + 16b + 8rs + r, o(128S + 32q + 4j + 2e_hi + e_lo)] + 8   (offset binary)

    for b, rs, e_hi, e_lo in 0..1, r in 0..7, q in 0..3, j in 0..7. Rows past N hold code 0.
    o is the identity for a group_size that is a multiple of 128; at g = 64 and 32 it is
    _step_order's permutation of each step, which puts the 16 k of every mma in one group:
    k = 128S + w t + (w / 4) q + 4 (j % (w / 16)) + 2e_hi + e_lo,
    t = j // (w / 16), w = g. qlab.pack_int4's plain order stays the teaching layout;
    unpack_int4_mma inverts this.
    """
    codes = torch.as_tensor(codes)
    if codes.ndim != 2 or codes.shape[1] % MMA_K:
        raise ValueError(
            f"pack_int4_mma needs codes (N, K) with K a multiple of {MMA_K}, got "
            f"{tuple(codes.shape)}; pad K or use qlab.pack_int4"
        )
    if codes.numel() and (int(codes.min()) < -8 or int(codes.max()) > 7):
        raise ValueError("pack_int4_mma takes signed int4 codes in -8..7; clamp them first")
    n, k = codes.shape
    tiles = triton.cdiv(n, MMA_ROWS)
    nib = torch.full((tiles * MMA_ROWS, k), 8, dtype=torch.uint8)  # padding rows: code 0
    nib[:n] = (codes.cpu()[:, _step_order(group_size, k)].to(torch.int16) + 8).to(torch.uint8)
    # shape: (T, b, rs, r, S, q, j // 4, j % 4, e_hi, e_lo)
    nib = nib.reshape(tiles, 2, 2, 8, k // MMA_K, 4, 2, 4, 2, 2)
    # shape: (T, S, c = (b, j // 4), lane = (r, q), v = j % 4, p = (e_lo, e_hi, rs))
    nib = nib.permute(0, 4, 1, 6, 3, 5, 7, 9, 8, 2).reshape(tiles, k // MMA_K, 4, 32, 4, 8)
    words = torch.zeros(nib.shape[:-1], dtype=torch.int64)
    for p in range(8):  # one byte-sized pass per nibble position: memory stays ~3 N K bytes
        words |= nib[..., p].to(torch.int64) << (4 * p)  # 0 .. 2**32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(tiles, 4 * k).to(codes.device)


def unpack_int4_mma(words: torch.Tensor, n: int, *, group_size: int) -> torch.Tensor:
    """Inverse of pack_int4_mma: int32 words (ceil(n / 32), 4 * K) -> int8 codes (n, K)."""
    tiles, k4 = words.shape
    k = k4 // 4
    w = words.to(torch.int64).cpu() & 0xFFFFFFFF
    nib = (w.reshape(tiles, k // MMA_K, 4, 32, 4, 1) >> (4 * torch.arange(8))) & 0xF
    # shape: (T, S, b, j // 4, r, q, j % 4, e_lo, e_hi, rs) -> (T, b, rs, r, S, q, j, e)
    nib = nib.reshape(tiles, k // MMA_K, 2, 2, 8, 4, 4, 2, 2, 2)
    nib = nib.permute(0, 2, 9, 4, 1, 5, 3, 6, 8, 7).reshape(tiles * MMA_ROWS, k)
    codes = torch.empty(n, k, dtype=torch.int8)
    codes[:, _step_order(group_size, k)] = (nib[:n] - 8).to(torch.int8)
    return codes.to(words.device)


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


def _mma_step_asm(bf16: bool) -> str:
    """PTX of one K step of the tensor-core GEMV, for one thread (a warp runs it together).

    Operands: $0..$3 the four fp32 sums out; $4..$19 the thread's 16 weight words (decode
    layout: words 0-7 the rows of mma block 0, 8-15 of block 1); $20..$35 its 16 words of
    x as 16-bit pairs (x[32q .. 32q + 31] when one group spans the step; at g = 64 and 32
    the layout's k, zero outside the group of the thread's B column); $36..$39 the rows'
    scales (fp32; of group q * GPS // 4 at g = 64 and 32); $40..$43 the sums in. Per word:
    4 LOP3 (and 1 or 3 shifts) give four 16-bit pairs (bf16: 128 + n, n = code + 8; fp16:
    two of 1024 + n, two of 1024 + 16 n), one HADD2/HFMA2 each leaves the code (a - 136 in
    bf16; a - 1032, or a / 16 - 72, in fp16), one HMMA.
    """
    ty = "bf16" if bf16 else "f16"
    magic = "0x43004300" if bf16 else "0x64006400"
    lines = [
        "{",
        ".reg .b32 a0, a1, a2, a3, t, k_mul, k_add, k_sub;",
        ".reg .f32 d0, d1, d2, d3, z;",
        "mov.f32 z, 0f00000000;",
        # 16-bit pairs take no immediates in PTX: a * k_mul + k_add, a + k_sub
        # bf16: 128 + n -> n - 8 = a * 1 - 136
        # fp16: 1024 + n -> n - 8 = a - 1032; 1024 + 16 n -> n - 8 = a / 16 - 72
        "mov.b32 k_mul, 0x3f803f80;" if bf16 else "mov.b32 k_mul, 0x2c002c00;",
        "mov.b32 k_add, 0xc308c308;" if bf16 else "mov.b32 k_add, 0xd480d480;",
        "mov.b32 k_sub, 0xe408e408;",
    ]
    for b in range(2):  # two 16-row mma blocks share the x fragments
        for j in range(8):  # eight m16n8k16 along this step's K
            w, xa, xb = f"${4 + 8 * b + j}", f"${20 + 2 * j}", f"${21 + 2 * j}"
            if bf16:  # a bf16 mantissa holds 7 bits: every nibble shifted down to bit 0
                lines += [
                    f"lop3.b32 a0, {w}, 0x000f000f, {magic}, 0xea;",
                    f"shr.b32 t, {w}, 4;",
                    f"lop3.b32 a1, t, 0x000f000f, {magic}, 0xea;",
                    f"shr.b32 t, {w}, 8;",
                    f"lop3.b32 a2, t, 0x000f000f, {magic}, 0xea;",
                    f"shr.b32 t, {w}, 12;",
                    f"lop3.b32 a3, t, 0x000f000f, {magic}, 0xea;",
                ]
                lines += [f"fma.rn.bf16x2 a{i}, a{i}, k_mul, k_add;" for i in range(4)]
            else:  # fp16: the high nibble of a byte is read in place as 16 n, scaled by 1/16
                lines += [
                    f"lop3.b32 a0, {w}, 0x000f000f, {magic}, 0xea;",
                    f"lop3.b32 a1, {w}, 0x00f000f0, {magic}, 0xea;",
                    f"shr.b32 t, {w}, 8;",
                    f"lop3.b32 a2, t, 0x000f000f, {magic}, 0xea;",
                    f"lop3.b32 a3, t, 0x00f000f0, {magic}, 0xea;",
                    "add.f16x2 a0, a0, k_sub;",
                    "fma.rn.f16x2 a1, a1, k_mul, k_add;",
                    "add.f16x2 a2, a2, k_sub;",
                    "fma.rn.f16x2 a3, a3, k_mul, k_add;",
                ]
            c = "z, z, z, z" if j == 0 else "d0, d1, d2, d3"
            lines.append(
                f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{d0, d1, d2, d3}}, "
                f"{{a0, a1, a2, a3}}, {{{xa}, {xb}}}, {{{c}}};"
            )
        # d0 (row r) and d2 (row r + 8) are column 2q; d1 and d3 (column 2q + 1, the same x:
        # all columns, or one group's) are not used
        lines += [
            f"fma.rn.f32 ${2 * b}, d0, ${36 + 2 * b}, ${40 + 2 * b};",
            f"fma.rn.f32 ${2 * b + 1}, d2, ${37 + 2 * b}, ${41 + 2 * b};",
        ]
    return "\n".join(lines + ["}"])


MMA_ASM_F16 = tl.constexpr(_mma_step_asm(bf16=False))
MMA_ASM_BF16 = tl.constexpr(_mma_step_asm(bf16=True))
MMA_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 32 + ["f"] * 8))


@triton.jit
def _mma_step(w_step, x_step, x_group, s, acc, BF16: tl.constexpr, GPS: tl.constexpr):
    """One K step of every thread: tl.load(...) of the thread's words and x, then
    _mma_step_asm. Words 4c..4c+3 of x feed mmas 2c and 2c + 1, whose k lie in group c * GPS
    // 4 of the step; with GPS > 1 a thread loads them only if that is x_group (else 0)."""
    XC: tl.constexpr = 4 // GPS  # 16-byte loads of x per group
    XG: tl.constexpr = 64 // GPS  # words of x per group
    w = [tl.load(w_step), tl.load(w_step + 128), tl.load(w_step + 256), tl.load(w_step + 384)]
    if GPS == 1:
        x = [tl.load(x_step), tl.load(x_step + 4), tl.load(x_step + 8), tl.load(x_step + 12)]
    else:
        x = [
            tl.load(x_step, mask=x_group == 0, other=0),
            tl.load(x_step + XG * (1 // XC) + 4 * (1 % XC), mask=x_group == 1 // XC, other=0),
            tl.load(x_step + XG * (2 // XC) + 4 * (2 % XC), mask=x_group == 2 // XC, other=0),
            tl.load(x_step + XG * (3 // XC) + 4 * (3 % XC), mask=x_group == 3 // XC, other=0),
        ]
    if BF16:
        return tl.inline_asm_elementwise(MMA_ASM_BF16, MMA_CONSTRAINTS, w + x + [s, acc],
                                         dtype=tl.float32, is_pure=True, pack=4)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(MMA_ASM_F16, MMA_CONSTRAINTS, w + x + [s, acc],
                                         dtype=tl.float32, is_pure=True, pack=4)  # fmt: skip


@triton.jit
def _w4a16_gemv_mma_kernel(
    # pointers
    x_ptr,  # fp16/bf16 (K,), 16-byte aligned
    words_ptr,  # int32 (ceil(N / 32), 4 K): pack_int4_mma(codes, group_size=GROUP_SIZE)
    scales_ptr,  # fp16 (N, K // GROUP_SIZE)
    out_ptr,  # x's dtype (N,)
    ws_ptr,  # fp32 split-K workspace
    count_ptr,  # int32 split-K counters
    # sizes
    N,
    K,
    # strides
    stride_wt,  # words per 32-row tile: 4 K
    stride_sn,
    # split-K: programs per row block, each summing K // split_k
    split_k,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,  # 32, 64 or a multiple of _MMA_K (groups_per_step)
    GPS: tl.constexpr,  # scale groups per K step of _MMA_K: groups_per_step(GROUP_SIZE, K)
    BLOCK_N: tl.constexpr,  # 32 rows per warp
    USE_ASM: tl.constexpr,  # the tensor-core PTX; False: the same sums in plain Triton
    INDEX_64: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_len = K // split_k
    k_start = tl.multiple_of(pid_k * k_len, _MMA_K)
    num_tiles = tl.cdiv(N, _MMA_ROWS)
    if USE_ASM:
        # Thread t = 32 warp + lane, lane = 4r + q: its row in every mma fragment is r (and
        # r + 8), its share of K is 32 k of each step: x[32q .. 32q + 31] when one group
        # spans the step, else 128 / GPS / 4 k of each group (_step_order). A (THREADS, 4)
        # tensor of 16-byte rows puts row t in thread t (Triton's blocked layout [1, 4] x
        # [32, 1]). With GPS groups per step, column n of the mma's B operand carries x only
        # in the mmas of group n * GPS // 8 (zeros in the others), so the D columns 2q, 2q + 1
        # a thread holds are the sums of group q * GPS // 4 alone, and it scales them by
        # that group's scale: one scale per row per step, whatever the group size.
        THREADS: tl.constexpr = BLOCK_N // _MMA_ROWS * 32
        t = tl.arange(0, THREADS)[:, None]  # shape: (THREADS, 1)
        lane = t % 32
        r = lane // 4
        q = lane % 4
        tile = tl.minimum(pid_n * (BLOCK_N // _MMA_ROWS) + t // 32, num_tiles - 1)
        if INDEX_64:
            tile = tile.to(tl.int64)
        v = tl.arange(0, 4)[None, :]  # shape: (1, 4)
        # rows of the thread's four sums: (block 0, r), (block 0, r + 8), (1, r), (1, r + 8)
        offs_n = pid_n * BLOCK_N + (t // 32) * _MMA_ROWS + 16 * (v // 2) + 8 * (v % 2) + r
        rows = tl.minimum(offs_n, N - 1)
        if INDEX_64:
            rows = rows.to(tl.int64)
        w_ptrs = words_ptr + tile * stride_wt + lane * 4 + v  # + 512 S + 128 c
        # words of x: + 64 S, + 4 c at one group per step (_mma_step's offsets)
        x_ptrs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + q * (16 // GPS) + v
        s_ptrs = scales_ptr + rows * stride_sn + q * GPS // 4  # the group of my D columns
        acc = tl.zeros((THREADS, 4), dtype=tl.float32)
        for k0 in tl.range(k_start, k_start + k_len, _MMA_K):
            s = tl.load(s_ptrs + k0 // GROUP_SIZE).to(tl.float32)
            acc = _mma_step(w_ptrs + k0 * 4, x_ptrs + k0 // 2, r * GPS // 8, s, acc,
                            x_ptr.dtype.element_ty == tl.bfloat16, GPS)  # fmt: skip
        if GPS > 1:  # add the groups' partial sums: the four lanes q of a row r, each group once
            acc = tl.where(q % (4 // GPS) == 0, acc, 0.0)
            acc = tl.sum(tl.reshape(acc, (THREADS // 4, 4, 4)), axis=1)  # shape: ((warp, r), v)
            wr = tl.arange(0, THREADS // 4)[:, None]  # 8 warp + r
            offs_n = pid_n * BLOCK_N + (wr // 8) * _MMA_ROWS + 16 * (v // 2) + 8 * (v % 2)
            offs_n += wr % 8  # the rows, as above
        local = offs_n - pid_n * BLOCK_N
        store_or_reduce(
            acc, out_ptr + offs_n, offs_n < N, ws_ptr, count_ptr, local,
            pid_n, tl.num_programs(0), pid_k, split_k, TILE=BLOCK_N,
        )  # fmt: skip
    else:
        # The decode layout read element by element (pack_int4_mma's formula), fp32 sums.
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # shape: (BLOCK_N,)
        rows = tl.minimum(offs_n, N - 1)
        if INDEX_64:
            rows = rows.to(tl.int64)
        W: tl.constexpr = _MMA_K // GPS  # k per group in a step
        # the step's k in group-major order: (group t, thread q, i), as _step_order reads them
        kk = tl.arange(0, _MMA_K)[None, :]  # shape: (1, _MMA_K)
        t, q, i = kk // W, (kk // (W // 4)) % 4, kk % (W // 4)
        pos = (W // 4) * t + i  # where pack_int4_mma put that k in thread q's 32
        rr = (rows % _MMA_ROWS)[:, None]  # shape: (BLOCK_N, 1)
        b, rs, r = rr // 16, (rr // 8) % 2, rr % 8
        j, e = pos // 4, pos % 4
        word = 128 * (2 * b + j // 4) + 4 * (4 * r + q) + j % 4  # shape: (BLOCK_N, _MMA_K)
        shift = 4 * (rs + 2 * (e // 2) + 4 * (e % 2))
        w_ptrs = words_ptr + (rows // _MMA_ROWS)[:, None] * stride_wt + word
        s_ptrs = scales_ptr + rows[:, None] * stride_sn + tl.arange(0, GPS)[None, :]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in tl.range(k_start, k_start + k_len, _MMA_K):
            nib = (tl.load(w_ptrs + k0 * 4) >> shift) & 0xF
            code = (nib - 8).to(tl.float32)  # shape: (BLOCK_N, _MMA_K)
            xk = tl.load(x_ptr + k0 + kk).to(tl.float32)  # shape: (1, _MMA_K)
            sums = tl.sum(tl.reshape(code * xk, (BLOCK_N, GPS, W)), axis=2)  # code * x exact
            s = tl.load(s_ptrs + k0 // GROUP_SIZE).to(tl.float32)  # shape: (BLOCK_N, GPS)
            acc += tl.sum(sums * s, axis=1)
        store_or_reduce(
            acc, out_ptr + offs_n, offs_n < N, ws_ptr, count_ptr, tl.arange(0, BLOCK_N),
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


def _plan_gemv_mma(x2, w: W4A16Weight, out, config: Config, sms: int, buffers) -> Launch:
    """The tensor-core GEMV: config.block_n rows per program, one warp per 32 rows."""
    N, K = w.shape
    gps = groups_per_step(w.group_size, K)
    if gps is None:
        raise ValueError(f"no decode layout for group_size {w.group_size} at K = {K}")
    if config.block_n != MMA_ROWS * config.num_warps:
        raise ValueError(f"a decode config needs block_n = 32 * num_warps, got {config}")
    if config.block_k != MMA_K:
        raise ValueError(f"a decode config steps K by {MMA_K} (the layout's), got {config}")
    tiles = triton.cdiv(N, config.block_n)
    split = configs.split_k_for(tiles, K // MMA_K, sms)
    ws, counts = buffers(split, tiles, config.block_n, out.device)
    return Launch(
        kernel=_w4a16_gemv_mma_kernel,
        grid=(tiles, split),
        args=(x2, w.words, w.scales, out, ws, counts, N, K,
              w.words.stride(0), w.scales.stride(0), split),  # fmt: skip
        meta=dict(GROUP_SIZE=w.group_size, GPS=gps,
                  BLOCK_N=config.block_n, USE_ASM=not INTERPRET,
                  INDEX_64=needs_int64(w.words), num_warps=config.num_warps),  # fmt: skip
        config=config,
    )


def plan(x2, w: W4A16Weight, out, config: Config, sms: int, buffers=split_k_buffers) -> Launch:
    """The one launch w4a16_linear makes for x2 (M, K) with `config` (also what
    qlab.kernels.compile_for builds). M = 1 takes the GEMV (the tensor-core one on the
    decode layout when w.words exists, else the plain one), larger M the swap-AB GEMM."""
    M, K = x2.shape
    N = w.shape[0]
    g = w.group_size
    if M == 1 and w.words is not None:
        return _plan_gemv_mma(x2, w, out, config, sms, buffers)
    # no decode layout at M = 1 (groups_per_step None): the plain GEMV, one config. The K step
    # shrinks to divide the group, and the Launch reports the config it launches.
    config = configs.GEMV_PLAIN if M == 1 else config
    config = replace(config, block_k=_block_k(config, g))
    k_steps = K // config.block_k
    if M == 1:
        tiles = triton.cdiv(N, config.block_n)
        split = configs.split_k_for(tiles, k_steps, sms)
        ws, counts = buffers(split, tiles, config.block_n, out.device)
        return Launch(
            kernel=_w4a16_gemv_kernel,
            grid=(tiles, split),
            args=(x2, w.packed, w.scales, out, ws, counts, N, K,
                  w.packed.stride(0), w.scales.stride(0), split),  # fmt: skip
            meta=dict(GROUP_SIZE=g, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
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
            GROUP_SIZE=g, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
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
    check_device(x, w.packed, w.scales, *(() if w.words is None else (w.words,)))

    x2 = x.reshape(-1, K)  # shape: (M, K)
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.reshape(*x.shape[:-1], N)
    if x2.data_ptr() % 16:  # the GEMV reads x as 32-bit words; keep every load aligned
        x2 = x2.clone()
    sms = configs.device_sms()
    key = (N, K, w.group_size, str(x.dtype))
    if M == 1 and w.words is None:
        config = configs.GEMV_PLAIN  # what plan runs for this weight whatever it is given
    else:
        config = configs.choose("w4a16", M, key, lambda c: plan(x2, w, out, c, sms)())
    plan(x2, w, out, config, sms)()
    return out.reshape(*x.shape[:-1], N)
