"""Chapter 15 (GGUF): decode a Q4_0 block from its bytes, the Q4_K super-block scales,
and llama.cpp's Q8_0 quantizer with its own rounding.

Spec clauses, and the fixed case (present on every seed) where breaking each one changes
the answer (tests/grading/mutants_ch15.py holds a mutant per clause):

decode_q4_0(blocks uint8 (n, 18)) -> float32 (n, 32)
  D1 d = bytes 0-1 as a little-endian float16 ........................... "edges" every row
  D2 byte 2 + j: low nibble = element j, high nibble = element j + 16 .... "edges" row 0, 1
  D3 x = d * (q - 8): offset 8, not a sign-extended nibble ............... "edges" row 1
  D4 one float32 multiply d * (q - 8) (not q*d - 8*d: inf - inf) ......... "edges" row 2
  D5 that multiply in float32, not float16 (d has 11 significant bits with
     the last one set, so d * 3 needs 13; -8 d overflows float16) ........ "edges" row 3
  D6 a float32 result (the dtype is graded) .............................. every case
q4k_scales(blocks uint8 (n, 144)) -> (scales float32 (n, 8), mins float32 (n, 8))
  K1 d = bytes 0-1, dmin = bytes 2-3 (float16); scale = d * sc, min = dmin * m .. every row
  K2 sub-blocks 0-3: sc = s[j] & 63, m = s[j + 4] & 63 (s = bytes 4..15) . "edges" row 0
  K3 sub-blocks 4-7: low 4 bits from s[j + 4] (sc low nibble, m high
     nibble), top 2 bits from bits 6-7 of s[j - 4] (sc) and s[j] (m) .... "edges" row 0
  K4 d * sc and dmin * m in float32, not float16 (d and dmin have their
     last mantissa bit set, so d * 17 needs 15 significant bits) ........ "edges" row 0
  K5 scales and mins float32 (the dtypes are graded) ..................... every case
quantize_q8_0(x float32 (n, 32 k)) -> (d float16 (n, k), q int8 (n, 32 k))
  Q1 d = absmax / 127 in float32 (absmax of a negative value too) ........ "edges" row 1
  Q2 q = roundf(x * (1 / d)): multiply by the float32 reciprocal ......... "edges" row 2
  Q3 ties round half AWAY from zero (both signs) ......................... "edges" row 0
  Q4 codes from the float32 d; d rounded to float16 only when stored ..... "edges" row 3
  Q5 an all-zero block: d = 0, q = 0 ..................................... "edges" row 4
  Q6 roundf exactly: +-0.49999997 gives 0 (floor(|y| + 0.5) and
     trunc(y + copysign(0.5, y)) give +-1: |y| + 0.5 rounds to 1.0) ...... "edges" row 5
  Q7 d = absmax / 127, a division (absmax * (1 / 127) moves a code) ..... "edges" row 6
  Q8 d float16, q int8 (the dtypes are graded) ........................... every case
"""

from __future__ import annotations

import torch

import qlab
import qlab.gguf as G
from qlab.grading.registry import Mismatch, exact, tasks_for
from qlab.grading.tasks._inputs import choice, randint, rounding_splits, weights
from qlab.grading.tasks._spec import hex_byte, num
from qlab.scales import round_half_away

task = tasks_for("15_gguf")


def _rand_bytes(g: torch.Generator, n: int, size: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)


def _fp16_bytes(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float16).view(torch.uint8)


def _odd_fp16(g: torch.Generator, exponent: int) -> float:
    """A random float16 in [2^exponent, 2^(exponent + 1)) with its last mantissa bit set
    (11 significant bits), so its products with odd integers > 1 round in float16."""
    return (1 + (2 * randint(g, 0, 511) + 1) / 1024) * 2.0**exponent


# --------------------------------------------------------------------------- Q4_0 decode


def _q4_0_edges(g: torch.Generator) -> torch.Tensor:
    """Row 0: a real block whose halves differ (positive first half, negative second) with a
    scale whose two bytes differ; row 1: every nibble value in both halves, in different
    orders; row 2: d = +inf (an fp16 scale overflow) with codes on both sides of 8; row 3: a
    float16 d in [8192, 16384) with its last mantissa bit set, codes 0 and 11 among random
    ones: d * -8 and d * 3 are exact in float32 but overflow / round in float16."""
    w = weights(g, (1, 32)).abs() + 0.01
    w[0, 16:] = -w[0, 16:] * 0.5
    rows = [G.quantize(w, "Q4_0").data[0]]
    lo = torch.randperm(16, generator=g).to(torch.uint8)
    hi = torch.randperm(16, generator=g).to(torch.uint8)
    d = 0.01 * randint(g, 1, 9) + 0.001  # bytes differ: swapping them gives another value
    rows.append(torch.cat([_fp16_bytes(d), lo | (hi << 4)]))
    codes = _rand_bytes(g, 1, 16)[0]
    codes[0] = 0x1F  # q = 15 and q = 1: inf * (q - 8) = +-inf, while q*d - 8*d = inf - inf
    rows.append(torch.cat([_fp16_bytes(float("inf")), codes]))
    codes = _rand_bytes(g, 1, 16)[0]
    codes[randint(g, 0, 15)] = 0xB0  # q = 0 (x = -8 d) and q = 11 (x = 3 d)
    rows.append(torch.cat([_fp16_bytes(_odd_fp16(g, 13)), codes]))
    return torch.stack(rows)


def _q4_0_cases(g: torch.Generator):
    cases = [(_q4_0_edges(g),)]
    for _ in range(2):
        w = weights(g, (randint(g, 1, 4), 32 * randint(g, 1, 3)), outliers=True)
        cases.append((G.quantize(w, "Q4_0").data.reshape(-1, 18),))
    cases.append((_rand_bytes(g, randint(g, 1, 6), 18),))  # every bit pattern
    return cases


def _q4_0_explain(args, m: Mismatch) -> str:
    """d, the byte and nibble of the bad element, and d * (q - 8) in float32 (and float16)."""
    (blocks,) = args
    r, i = m.index
    d = blocks[r, 0:2].contiguous().view(torch.float16)
    byte = int(blocks[r, 2 + i % 16])
    q = byte & 0xF if i < 16 else byte >> 4
    x = d.float() * (q - 8)
    note = (f"block {r}: d = bytes 0-1 (little-endian float16) = {num(d)}; element {i} is the "
            f"{'low' if i < 16 else 'high'} nibble of byte {2 + i % 16} = {hex_byte(byte)}: "
            f"q = {q}, d * (q - 8) = {num(x)} in float32")
    if not torch.equal(torch.nan_to_num((d * (q - 8)).float()), torch.nan_to_num(x)):
        note += f" (in float16 it would be {num(d * (q - 8))}: multiply in float32)"
    return note


task("q4_0_decode", "decode_q4_0", points=3,
     implements=("qlab.gguf.types.dequantize",
                 "qlab.gguf.legacy.dequantize",
                 "qlab.gguf.legacy.unpack",),
     reference=lambda blocks: G.from_bytes("Q4_0", (len(blocks), 32), blocks).dequantize(),
     compare=exact(explain=_q4_0_explain),
     signature="decode_q4_0(blocks uint8 (n, 18)) -> float32 (n, 32)")(_q4_0_cases)


# --------------------------------------------------------------------------- Q4_K scales

# Every 6-bit value has its own pattern of high bits, so taking a top-2-bit field from the
# wrong byte, or a nibble from the wrong half, changes at least one output.
_SC = torch.tensor([[63, 0, 17, 48, 33, 62, 5, 40]], dtype=torch.uint8)
_M = torch.tensor([[1, 60, 32, 15, 63, 16, 47, 2]], dtype=torch.uint8)


def _q4k_edges(g: torch.Generator) -> torch.Tensor:
    """Row 0: crafted sub-block scales/mins (_SC, _M) under random float16 d in [2^-6, 2^-5)
    and dmin in [2^-9, 2^-8) (never equal: swapping them shows), each with its last mantissa
    bit set (so d * sc rounds in float16 for every odd sc > 1); row 1: a real super-block."""
    head = torch.cat([_fp16_bytes(_odd_fp16(g, -6)), _fp16_bytes(_odd_fp16(g, -9))])
    crafted = torch.cat([head, G.kquants.pack_scales_k4(_SC, _M)[0], _rand_bytes(g, 1, 128)[0]])
    real = G.quantize(weights(g, (1, 256), outliers=True), "Q4_K").data[0]
    return torch.stack([crafted, real])


def _q4k_cases(g: torch.Generator):
    cases = [(_q4k_edges(g),)]
    w = weights(g, (randint(g, 1, 3), 256 * randint(g, 1, 2)))
    cases.append((G.quantize(w, "Q4_K").data.reshape(-1, 144),))
    cases.append((_rand_bytes(g, randint(g, 2, 6), 144),))  # every bit pattern
    return cases


def _q4k_reference(blocks: torch.Tensor):
    f = G.from_bytes("Q4_K", (blocks.shape[0], 256), blocks).fields
    scales = f["d"].float()[:, None] * f["sc"].float()
    mins = f["dmin"].float()[:, None] * f["m"].float()
    return scales, mins


def _q4k_explain(args, m: Mismatch) -> str:
    """The super-block scale, the 6-bit value of the bad sub-block and their float32 product
    (and the float16 one where it differs)."""
    (blocks,) = args
    r, j = m.index
    f = G.from_bytes("Q4_K", (blocks.shape[0], 256), blocks).fields
    head, six = ("d", "sc") if m.output == "scales" else ("dmin", "m")
    big, small = f[head][r], int(f[six][r, j])
    prod = big.float() * small
    note = (f"super-block {r}: {head} = {num(big)} (float16), {six}[{j}] = {small} (6 bits), "
            f"{head} * {six}[{j}] = {num(prod)} in float32")
    if not torch.equal(torch.nan_to_num((big * small).float()), torch.nan_to_num(prod)):
        note += f" (in float16 it would be {num(big * small)}: multiply in float32)"
    return note


task("q4_k_scales", "q4k_scales", points=3, reference=_q4k_reference,
     implements=("qlab.gguf.kquants.unpack_scales_k4",),
     compare=exact(names=("scales", "mins"), explain=_q4k_explain),
     signature="q4k_scales(blocks uint8 (n, 144)) -> (scales float32 (n, 8), mins (n, 8))"
     )(_q4k_cases)


# --------------------------------------------------------------------------- Q8_0 quantize


def _reciprocal_trap(g: torch.Generator) -> torch.Tensor:
    """A block with d = amax / 127 exact and one x with x / d == k + 0.5 exactly, but
    x * fp32(1 / d) just below it: roundf gives k + 1 dividing, k multiplying (the spec)."""
    d = (1 + torch.arange(1024) / 1024).to(torch.float16).float() * 2.0 ** randint(g, -8, -4)
    hit = torch.empty(0, dtype=torch.long)
    while hit.numel() == 0:
        k = randint(g, 1, 120)
        x = (k + 0.5) * d  # exact (<= 7 + 11 significant bits), as is 127 * d
        hit = (round_half_away(x * (1.0 / d)) != round_half_away(x / d)).nonzero().flatten()
    i = int(hit[randint(g, 0, hit.numel() - 1)])
    block = weights(g, (32,), scale=float(d[i]) * 20).clamp(-126 * d[i], 126 * d[i])
    block[0], block[5] = 127 * d[i], x[i]
    return block


def _fp16_trap(g: torch.Generator) -> torch.Tensor:
    """A block whose codes differ when computed from the fp16-rounded d instead of the fp32
    d (x just past a half-step on one scale, before it on the other)."""
    for _ in range(500):
        amax = float(torch.empty(()).uniform_(0.5, 4.0, generator=g))
        d32 = torch.tensor(amax) / 127
        inv32 = 1.0 / d32
        inv16 = 1.0 / d32.to(torch.float16).float()
        k = randint(g, 3, 120)
        x = torch.tensor((k + 0.5) / float(inv32 + inv16) * 2)  # between the two tie points
        if round_half_away(x * inv32) != round_half_away(x * inv16):
            block = weights(g, (32,), scale=amax / 4).clamp(-amax * 0.99, amax * 0.99)
            block[0], block[9] = -amax, x
            return block
    raise RuntimeError("no fp16 trap found")


BELOW_HALF = 0.5 - 2.0**-25  # 0.49999997, the float32 just below one half


def _roundf_trap(g: torch.Generator) -> torch.Tensor:
    """d = 1 (absmax 127): y = x exactly. +-0.49999997, where roundf gives 0 but |y| + 0.5
    rounds to 1.0 in float32, next to ties and other values one ulp from a half."""
    near = torch.tensor([BELOW_HALF, 0.5, 1.5, 2.5])
    near = torch.cat([near, torch.nextafter(near[1:], torch.zeros(3))])  # ulp below the ties
    row = weights(g, (32,), scale=20.0).clamp(-126, 126)
    row[: 1 + 2 * len(near)] = torch.cat([torch.tensor([127.0]), near, -near])
    return row[torch.randperm(32, generator=g)]


def _d_division_trap(g: torch.Generator) -> torch.Tensor:
    """A block whose d = absmax / 127 differs from absmax * fp32(1 / 127) in float32, with
    an x whose code differs between the two reciprocals of d."""
    inv127 = torch.tensor(1.0) / 127
    for _ in range(500):
        amax = torch.empty(()).uniform_(0.5, 4.0, generator=g)
        inv_a, inv_b = 1.0 / (amax / 127), 1.0 / (amax * inv127)
        if inv_a == inv_b:
            continue
        hits = rounding_splits(lambda v, i=inv_a: round_half_away(v * i),
                               lambda v, i=inv_b: round_half_away(v * i),
                               (torch.arange(30, 121) + 0.5) / inv_a, g)  # near code ties
        if hits.numel():
            block = weights(g, (32,), scale=float(amax) / 4).clamp(-0.99 * amax, 0.99 * amax)
            block[0], block[7] = amax * choice(g, (1.0, -1.0)), hits[0]
            return block
    raise RuntimeError("no absmax / 127 trap found")


def _q8_edges(g: torch.Generator) -> torch.Tensor:
    """Row 0: ties k + 0.5 of both signs at d = 1; row 1: the absmax is negative; row 2:
    the reciprocal trap; row 3: the fp16 trap; row 4: all zeros; row 5: roundf's
    0.49999997; row 6: absmax / 127 against absmax * (1 / 127)."""
    ties = torch.arange(-15, 16, dtype=torch.float32)[:31] + 0.5
    row0 = torch.cat([torch.tensor([127.0]), ties])
    row1 = weights(g, (32,), scale=0.1)
    row1[randint(g, 0, 31)] = -row1.abs().max() * 3
    rows = [row0, row1, _reciprocal_trap(g), _fp16_trap(g), torch.zeros(32), _roundf_trap(g),
            _d_division_trap(g)]
    return torch.stack(rows)


def _q8_cases(g: torch.Generator):
    cases = [(_q8_edges(g),)]
    cases.append((weights(g, (randint(g, 1, 4), 32 * randint(g, 1, 4)), outliers=True),))
    return cases


def _q8_reference(x: torch.Tensor):
    qt = qlab.quantize(x, "q8_0")
    return qt.scales, qt.codes


def _q8_explain(args, m: Mismatch) -> str:
    """llama.cpp's operations at the first bad element, and the variant that differs there."""
    (x,) = args
    r, c = m.index
    j = c if m.output == "d" else c // 32
    block = x[r, 32 * j : 32 * (j + 1)]
    amax = block.abs().max()
    d = amax / 127
    head = f"block {j} of row {r}: absmax = {num(amax)}, d = absmax / 127 = {num(d)} (float32)"
    if amax * (torch.tensor(1.0) / 127) != d:
        head += f"; absmax * (1 / 127) = {num(amax * (torch.tensor(1.0) / 127))} differs: divide"
    if m.output == "d" or d == 0:
        return head + ("; an all-zero block: d = 0, codes 0" if d == 0 else "")
    inv = 1.0 / d
    v = x[r, c]
    y = v * inv
    note = f"{head}; id = 1 / d = {num(inv)}; x = {num(v)}, x * id = {num(y)}"
    if round_half_away(v / d) != round_half_away(y):
        note += f" (x / d = {num(v / d)} rounds otherwise: multiply by id, as llama.cpp does)"
    if round_half_away(v * (1.0 / d.half().float())) != round_half_away(y):
        note += " (the codes come from the float32 d; d is rounded to float16 only when stored)"
    if (y - y.trunc()).abs() == 0.5:
        note += f": a tie, roundf rounds half away from zero: {int(round_half_away(y))}"
    elif y.abs() == BELOW_HALF:
        note += (": just below one half, roundf gives 0 (floor(|y| + 0.5) gives 1: |y| + 0.5 "
                 "rounds up to 1.0 in float32)")
    return note


task("q8_0_quantize", "quantize_q8_0", points=2, reference=_q8_reference,
     implements=("qlab.quantize",
                 "qlab.gguf.types.quantize",
                 "qlab.gguf.legacy.quantize",
                 "qlab.scales.ggml_q8_0",),
     compare=exact(names=("d", "q"), explain=_q8_explain),
     signature="quantize_q8_0(x float32 (n, 32 k)) -> (d float16 (n, k), q int8 (n, 32 k))"
     )(_q8_cases)
