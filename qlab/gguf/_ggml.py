"""llama.cpp's scalar arithmetic, reproduced in vectorised torch float32.

ggml-quants.c is plain C on `float`: every +, -, *, / and sqrtf is one IEEE-754 single
precision operation, and every sum is a left-to-right loop. The helpers here keep both:
each torch op below is one C operation, and sums run element by element in C's order,
vectorised over blocks. Constants such as 0.1f are float32 values. Two torch traps are
avoided on purpose: `scalar / tensor` is computed as reciprocal(tensor) * scalar (two
roundings; use div), and float32 torch.sqrt on AVX-512 CPUs is not correctly rounded
(measured: 17 % of results differ from the correctly rounded ones; use sqrtf).

Build note: that is the C source under strict IEEE semantics (no fused multiply-add), what a
compiler gives with -ffp-contract=off. Code that fuses a*b + c into one FMA writes other
bytes now and then: ggml-quants.c compiled with gcc 12 -O2 -march=native (GCC's GNU-mode
default is -ffp-contract=fast) on an AVX-512 CPU, 200 rows of 1024 Gaussian weights: 3 % of
Q5_K's bytes, 0.4 % of Q4_K's, 0.07-0.15 % of the importance-matrix Q4_0 ... Q5_1 differ.
Which llama.cpp builds fuse: its CMake puts ggml-quants.c in the ggml-base library, and
GGML_NATIVE's -march=native (ARCH_FLAGS) is a private option of the ggml-cpu library only
(ggml/src/ggml-cpu/CMakeLists.txt), so a default x86-64 build compiles the quantizers for
baseline x86-64, which has no FMA instruction, and does not fuse. Builds that can fuse:
ARM64 ones (FMA is in the base instruction set, Apple silicon included, and by default
GCC, in the GNU C mode llama.cpp's CMake selects, and clang, within an expression, both
contract a*b + c) and any build given FMA flags for all files, e.g. CFLAGS=-march=native.
Decoding and the reference Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 encoders are unaffected.
"""

from __future__ import annotations

import math

import numpy as np
import torch

QK_K = 256  # elements in one K-quant super-block
GROUP_MAX_EPS = float(np.float32(1e-15))  # ggml-quants.c: a group below this is all zero
_MAGIC = 12582912.0  # 1.5 * 2^23: adding it leaves the rounded integer in the low mantissa bits


def f32(v: float) -> float:
    """The float32 value of a C float constant such as 0.1f (as a Python float, exactly)."""
    return float(np.float32(v))


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int(fval): fval + 1.5 * 2^23 in float32, then the low 23 bits minus 2^22.

    The float add rounds to the nearest integer with ties to EVEN (the FPU's default mode),
    so for |v| < 2^22 this is round-half-to-even, the same rounding as torch.round and the
    rest of qlab. (Q8_0 uses C's roundf instead, ties away from zero; Q4_0/Q4_1/Q5_0/Q5_1
    use (int)(v + 0.5), ties up.) A NaN gives 0, as in C: the NaN that float arithmetic
    creates has only its quiet bit (2^22) in the mantissa, which the - 2^22 cancels; this is
    how llama.cpp's K-quants turn a NaN sub-block scale into a stored 0. Returns int32."""
    # every NaN (payload bits included) as 0.0, which gives 0: one pass, not isnan + where
    v = torch.nan_to_num(v.to(torch.float32), nan=0.0, posinf=math.inf, neginf=-math.inf)
    bits = (v + _MAGIC).view(torch.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def seq_sum(terms: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """C's `for (i...) acc += terms[i]` over the last axis, in order, in float32.

    start=None begins with terms[..., 0] (C's `float s = t[0];` then i from 1), else with
    `start` (C's `float s = 0;` passes zeros). Returns terms.shape[:-1]. The same additions
    in the same order as indexing terms[..., i]; the terms are first laid out as contiguous
    rows, which halves the time of a (366k, 32) sum (measured, 1 core)."""
    cols = terms.movedim(-1, 0).contiguous()  # shape: (n, *terms.shape[:-1])
    if start is None:
        acc, cols = cols[0].clone(), cols[1:]
    elif len(cols) == 0:
        return start  # no terms: nothing added
    else:
        acc, cols = start + cols[0], cols[1:]
    for row in cols:
        acc += row  # in place: acc is this function's own tensor
    return acc


def sum_from_zero(terms: torch.Tensor) -> torch.Tensor:
    """`float s = 0; for (...) s += t[i];` over the last axis."""
    return seq_sum(terms, torch.zeros(terms.shape[:-1], dtype=torch.float32))


def div(num: float | torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """C's float division num / den, correctly rounded even when num is a Python scalar."""
    return torch.as_tensor(num, dtype=torch.float32).expand_as(den) / den


def sqrtf(v: torch.Tensor) -> torch.Tensor:
    """C's sqrtf, correctly rounded: the float64 square root of a float32, rounded to float32
    (exact: 53 >= 2 * 24 + 2 bits, so no double rounding)."""
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def fp16(v: torch.Tensor) -> torch.Tensor:
    """GGML_FP32_TO_FP16: round to nearest even, overflow to inf (torch's cast does both)."""
    return v.to(torch.float16)


def as_u8(v: torch.Tensor) -> torch.Tensor:
    """C's cast of an int to uint8_t: keep the low 8 bits (wraps, like the reference)."""
    return (v.to(torch.int32) & 0xFF).to(torch.uint8)


def as_i8(v: torch.Tensor) -> torch.Tensor:
    """C's cast of an int to int8_t: the low 8 bits as two's complement."""
    return as_u8(v).view(torch.int8)


def first_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """C's `if (ax > amax) { amax = ax; max = x[i]; }` from amax = max = 0: the largest |x|
    and the signed element where it first occurs (+0.0 for an all-zero group). A NaN is
    never `> amax`, so it is skipped (a NaN sub-block scale does not become the maximum)."""
    ax = x.abs()
    ax = torch.where(torch.isnan(ax), torch.zeros_like(ax), ax)
    amax = ax.amax(dim=-1)
    signed = x.gather(-1, ax.argmax(dim=-1, keepdim=True))[..., 0]  # argmax: first maximum
    return amax, torch.where(amax == 0, torch.zeros_like(signed), signed)


def first_min(x: torch.Tensor) -> torch.Tensor:
    """C's `if (v < min) min = v;` over the last axis: the smallest element, taken where it
    first occurs, so a row whose minimum is zero keeps the sign of its first zero (-0.0 < +0.0
    is false; torch's amin may return either zero)."""
    return x.gather(-1, x.argmin(dim=-1, keepdim=True))[..., 0]


def first_max(x: torch.Tensor) -> torch.Tensor:
    """C's `if (v > max) max = v;`: the largest element where it first occurs (see first_min)."""
    return x.gather(-1, x.argmax(dim=-1, keepdim=True))[..., 0]
