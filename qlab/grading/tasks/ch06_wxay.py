"""Chapter 06 (WxAy): pack/unpack int4, the W8A8 reference step.

Spec clauses and the fixed case (every seed) that breaking each one changes:

pack_int4(codes (..., K)) -> uint8 (..., K // 2)
  P1 the even index goes in the LOW nibble .......................... "every nibble pair"
  P2 pairs are neighbours along the last axis ....................... every case
  P3 negative codes as 4-bit two's complement (& 0xF) ............... signed cases
  P4 any leading shape (..., K): 1-d and 3-d inputs ................. "shapes"
  P5 uint8 bytes (the dtype is graded) ............................... every case
unpack_int4(packed (..., K), signed) -> int8 (..., 2K)
  U1 (low nibble, high nibble) in that order ........................ "every byte" (both)
  U2 signed: nibbles 8..15 are -8..-1 ............................... "every byte, signed"
  U3 unsigned: 0..15 as they are .................................... "every byte, unsigned"
  U4 any leading shape .............................................. "shapes"
  U5 int8 codes (the dtype is graded) ................................ every case
w8a8_matmul(x (M, K), w (N, K)) -> float32 (M, N)
  W1 one activation scale per token (row of x) ...................... "loud token"
  W2 one weight scale per output channel (row of w) ................. "one-hot"
  W3 scales stored as float16; codes divide by the stored value ..... "one-hot" straddle
  W6 the float32 amax divided, then rounded to fp16 (not fp16(amax)) . "loud token" row 0
  W4 round half to even, true division .............................. "one-hot" ties
  W5 integer codes multiplied and summed exactly, rescaled once ..... every case
  W7 a float32 result (the dtype is graded) ......................... every case
  W8 codes clamped to +-127: a subnormal fp16 scale (below 2^-14),
     rounded down, puts amax / s past 127.5 ......................... "loud token" row 3
  (with a normal fp16 s the clamp never acts, as in chapter 01: |v / s| <= 127 (1 + 2^-11))
  (W3, W4, W6 pin qlab.quantize's order on purpose: the spec's first sentence says so, and the
  feedback names v * (1 / s), the float32 scale or fp16(amax) where they differ)
  The one-hot case makes single codes visible: row n of w is zero but for one weight at
  column k_n, so y[m, n] = q_x[m, k_n] * 127 * s_x[m] * s_w[n].
"""

from __future__ import annotations

import torch

import qlab
import qlab.pipelines
from qlab.grading.registry import Mismatch, close, exact, tasks_for
from qlab.grading.tasks._inputs import (
    choice,
    fp16_amax_trap,
    fp16_scale_straddle,
    fp16_subnormal_scale,
    randint,
    reciprocal_trap,
    weights,
)
from qlab.grading.tasks._spec import hex_byte, int8_row_note, num

task = tasks_for("06_wxay")


def _pack_explain(args, m: Mismatch) -> str:
    (codes,) = args
    *lead, j = m.index
    lo, hi = int(codes[(*lead, 2 * j)]), int(codes[(*lead, 2 * j + 1)])
    return (
        f"codes[..., {2 * j}] = {lo} (low nibble 0x{lo & 0xF:X}) and codes[..., {2 * j + 1}] = "
        f"{hi} (high nibble 0x{hi & 0xF:X}): expected byte {hex_byte(m.expected)}, "
        f"got {hex_byte(m.got)}"
    )


@task("pack_int4", "pack_int4", points=2, reference=lambda codes: qlab.pack_int4(codes),
      implements=("qlab.pack_int4",),
      compare=exact(explain=_pack_explain),
      signature="pack_int4(codes) -> packed uint8 (..., K // 2)")
def _pack_cases(g: torch.Generator):
    cases = []
    for signed in (True, False, True):
        lo, hi = (-8, 7) if signed else (0, 15)
        shape = (randint(g, 1, 5), 2 * randint(g, 1, 24))
        dtype = torch.int8 if signed else torch.uint8  # as qlab stores int4 / uint4 codes
        cases.append((torch.randint(lo, hi + 1, shape, generator=g).to(dtype),))
    # every pair of nibbles once
    a = torch.arange(16).repeat_interleave(16)
    b = torch.arange(16).repeat(16)
    cases.append((torch.stack([a, b], -1).reshape(1, -1).to(torch.uint8),))
    # shapes: 1-d and 3-d, signed, -8 and -1 included
    flat = torch.randint(-8, 8, (2 * randint(g, 2, 12),), generator=g).to(torch.int8)
    flat[:2] = torch.tensor([-8, -1])
    cases.append((flat,))
    cases.append((torch.randint(-8, 8, (2, 3, 2 * randint(g, 1, 6)), generator=g).to(torch.int8),))
    return cases


def _unpack_explain(args, m: Mismatch) -> str:
    packed, signed = args
    *lead, k = m.index
    byte = int(packed[(*lead, k // 2)])
    which = "low" if k % 2 == 0 else "high"
    return (
        f"it comes from byte packed[..., {k // 2}] = {hex_byte(byte)}, its {which} nibble "
        f"(even index: low), signed={signed}"
    )


@task("unpack_int4", "unpack_int4", points=2,
      implements=("qlab.unpack_int4",),
      reference=lambda packed, signed: qlab.unpack_int4(packed, signed=signed),
      compare=exact(explain=_unpack_explain),
      signature="unpack_int4(packed, signed) -> codes int8 (..., 2 * K)")
def _unpack_cases(g: torch.Generator):
    cases = []
    for signed in (True, False, choice(g, (True, False))):
        shape = (randint(g, 1, 5), randint(g, 1, 24))
        cases.append((torch.randint(0, 256, shape, generator=g).to(torch.uint8), signed))
    every = torch.randperm(256, generator=g).to(torch.uint8)
    cases.append((every.reshape(4, 64), True))
    cases.append((every.reshape(2, 2, 64), False))
    cases.append((torch.randint(0, 256, (randint(g, 1, 9),), generator=g).to(torch.uint8), True))
    return cases


def _w8a8_explain(args, m: Mismatch) -> str:
    x, w = args
    r, n = m.index
    qx, qw = (qlab.quantize(t, "int8", "channel") for t in (x, w))
    s_x, s_w = qx.scales.reshape(-1)[r], qw.scales.reshape(-1)[n]
    dot = int((qx.codes[r].long() * qw.codes[n].long()).sum())
    return (
        f"y[{r}, {n}] = (integer sum over k of q_x[{r}, k] * q_w[{n}, k] = {dot}) * "
        f"s_x[{r}] * s_w[{n}], with s_x[{r}] = {num(s_x)}, s_w[{n}] = {num(s_w)}; "
        + int8_row_note(f"x row {r}", x[r]) + "; " + int8_row_note(f"w row {n}", w[n])
    )


# the int8 products and their sums are exact; only the final rescale may round
# differently ((acc * s_x) * s_w vs acc * (s_x * s_w)): a few float32 ulps
@task("w8a8_matmul", "w8a8_matmul", points=3,
      implements=("qlab.pipelines.w8a8_reference", "qlab.quantize"),
      reference=lambda x, w: qlab.pipelines.w8a8_reference(x, w, "int8", "channel", "token"),
      compare=close(rtol=1e-6, explain=_w8a8_explain),
      signature="w8a8_matmul(x (M, K), w (N, K)) -> float32 (M, N)")
def _w8a8_cases(g: torch.Generator):
    cases = []
    for _ in range(3):
        m, n, k = randint(g, 1, 6), randint(g, 1, 6), choice(g, (16, 32, 64))
        x = weights(g, (m, k), outliers=True)
        w = weights(g, (n, k))
        cases.append((x, w))
    x = weights(g, (4, 32))
    x[2] *= 50.0  # one loud token: a per-tensor activation scale would crush the others
    w = weights(g, (3, 32))
    for t in (x, w):  # row 0: an absmax whose float16 rounding before / 127 moves the scale
        amax = fp16_amax_trap(g, 127)
        t[0] = (t[0] / t[0].abs().max() * amax).clamp(-amax, amax)
        t[0, randint(g, 0, 31)] = -amax
    amax = 127 * fp16_subnormal_scale(g, 127)  # row 3: a subnormal s_x, its clamp acts
    c = randint(g, 0, 31)
    x[3] = (x[3] / x[3].abs().max() * amax).clamp(-amax, amax)
    x[3, c], w[1, c] = amax, w[1].abs().max()  # q_x[3, c] meets q_w[1, c] = 127
    cases.append((x, w))
    cases.append(_one_hot(g))
    return cases


def _one_hot(g: torch.Generator):
    """x row 0: exact ties on a trap scale (amax = 127 step); x row 1: a float16 straddle
    at column 9. w: one-hot rows (column k_n, magnitudes 10^-1..10^1) reading single codes
    of x, and a dense row."""
    k = randint(g, 1, 31)
    step = reciprocal_trap(g, k) * 2.0 ** randint(g, -8, -5)
    x = torch.empty(2, 16).uniform_(-126, 126, generator=g)
    ties = torch.tensor([0.5, 2.5, -1.5, -0.5, 1.5, -2.5, k + 0.5, 127.0])
    x[0] = torch.cat([ties, x[0, 8:].round()]) * step
    amax, xk = fp16_scale_straddle(g, 127, 126)
    x[1] = x[1] / 127 * amax
    x[1, 9], x[1, 15] = xk, -amax
    cols = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9])
    w = torch.zeros(len(cols) + 1, 16)
    w[torch.arange(len(cols)), cols] = torch.logspace(-1, 1, len(cols)) * torch.where(
        torch.rand(len(cols), generator=g) < 0.5, -1.0, 1.0
    )
    w[-1] = weights(g, (16,))
    perm = torch.randperm(len(cols) + 1, generator=g)
    return (x, w[perm])
