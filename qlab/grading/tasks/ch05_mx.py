"""Chapter 05 (microscaling): the MX shared scale of each block; MXFP4 and NVFP4 quantization.

Spec clauses and the fixed case (every seed) that breaking each one changes:

mx_scale(x, element) -> float32 (R, K // 32), one case per element format (all five)
  X1 blocks of 32 contiguous elements ................................ "scale blocks"
  X2 floor(log2 amax) from the exponent bits, not log2 (amax one ulp
     below 2^e, where float32 log2 rounds up; amax exactly 2^e) ...... "scale blocks"
  X3 emax of the element format: 2, 2, 4, 8, 15 ..................... all five, every run
  X4 exponent clamped to [-127, 127]: a block with amax < 2^(emax-127)  "scale blocks" tiny
  X5 an all-zero block gets 2^-127 ................................... "scale blocks" zero
  X6 float32 scales (the dtype is graded) ............................ every case
mxfp4_quantize(x) -> (codes uint8 E2M1 (R, K), scales float32 (R, K // 32))
  M1 the scale of mx_scale with emax 2 (X2, X4, X5) .................. "mx edges"
  M2 elements E2M1(x / X), round half to even (ties both ways) ....... "mx edges" ties
  M3 saturation to +-6 (amax in [6X, 8X) ) ........................... "mx edges"
  M4 the sign bit is x's: -0.25 X rounds to -0, code 0x8 ............ "mx edges" ties
  M5 codes uint8, scales float32 (the dtypes are graded) ............. every case
nvfp4_quantize(x) -> (codes uint8 (R, K), block scales (R, K // 16), ts 0-d)
  V1 ts = amax / 2688 in one float32 division ....................... "nv traps"
  V2 bs = E4M3((block_amax / 6) / ts), in that order ................ "nv traps"
  V3 E4M3 rounding of bs is round half to even (ties down and up) ... "nv ties"
  V4 bs clamped below at 2^-6 (zero block; tiny block) .............. "nv traps"
  V5 x divided by the float32 product ts * bs ....................... "nv traps"
  V6 E2M1 elements round half to even ............................... "nv ties"
  V7 blocks of 16 contiguous ......................................... every multi-block row
  V8 the sign bit is x's: -0.25 ts bs rounds to -0, code 0x8 ........ "nv ties" block 2
  V9 codes uint8, block scales and ts float32 (the dtypes are graded)  every case
  (the clamp at 448 never acts: (block_amax / 6) / ts <= 448 up to rounding, which the
  saturating E4M3 encode absorbs; x is never all zeros, as the exercise states)
"""

from __future__ import annotations

import torch

import qlab
from qlab.grading.registry import Mismatch, exact, tasks_for
from qlab.grading.tasks._inputs import choice, randint, rounding_splits, weights
from qlab.grading.tasks._spec import grid_rounding, num, quantized

task = tasks_for("05_mx")
ELEMENTS = {
    "fp4_e2m1fn": "mxfp4",
    "fp6_e2m3fn": "mxfp6_e2m3",
    "fp6_e3m2fn": "mxfp6_e3m2",
    "fp8_e4m3fn": "mxfp8_e4m3",
    "fp8_e5m2": "mxfp8_e5m2",
}
BLOCK = 32  # OCP MX v1.0: k = 32
NV_BLOCK = 16
FP4, FP8 = qlab.formats.get("fp4_e2m1fn"), qlab.formats.get("fp8_e4m3fn")
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # RNE: 0, 1, 1, 2, 2, 4, 4
_POS = FP8.values[(FP8.values >= 1) & (FP8.values <= 200)]
_NOT_POW2 = _POS[torch.frexp(_POS).mantissa != 0.5]  # E4M3 block scales with mantissa bits
LOG2_ROUNDS_UP = (-6, -5, -4, -3, -2, 3, 4, 5, 6)  # float32 log2(2^e - ulp) == e here


def _mx_block(x: torch.Tensor, r: int, j: int, block: int) -> str:
    a = x[r, j * block : (j + 1) * block].abs().max()
    e = int(((a.view(torch.int32) >> 23) & 0xFF) - 127)
    return (
        f"row {r}, block {j} = columns {j * block}..{(j + 1) * block - 1}: amax = {num(a)}, "
        f"floor(log2 amax) from its exponent bits = {e}"
    )


def _scale_explain(args, m: Mismatch) -> str:
    x, element = args
    r, j = m.index
    emax = qlab.formats.get(element).emax
    return f"{_mx_block(x, r, j, BLOCK)}; emax({element}) = {emax}, clamp to [-127, 127]"


@task("mx_scale", "mx_block_scales", points=2,
      implements=("qlab.quantize", "qlab.scales.e8m0"),
      reference=lambda x, element: qlab.quantize(x, ELEMENTS[element]).scales,
      compare=exact(explain=_scale_explain),
      signature="mx_block_scales(x, element) -> float32 powers of two (R, K // 32)")
def _scale_cases(g: torch.Generator):
    cases = [(_scale_blocks(g), element) for element in ELEMENTS]  # every format, every run
    cases.insert(randint(g, 0, 5), (_random_blocks(g), choice(g, list(ELEMENTS))))
    return cases


def _random_blocks(g: torch.Generator) -> torch.Tensor:
    rows, k = randint(g, 1, 4), BLOCK * randint(g, 1, 4)
    return weights(g, (rows, k), outliers=bool(randint(g, 0, 1)))


def _scale_blocks(g: torch.Generator) -> torch.Tensor:
    """(4, 64): amax one ulp below 2^e (float32 log2 rounds up to e there), amax exactly
    2^e, an all-zero block and a tiny block (exponent -126: clamped for every emax >= 2),
    each in a random block; the other blocks random."""
    x = weights(g, (4, 2 * BLOCK), scale=0.1)
    e = choice(g, LOG2_ROUNDS_UP)
    slots = torch.randperm(8, generator=g).tolist()  # (row, block) = divmod(slot, 2)
    for slot, kind in zip(slots, ("below", "at", "zero", "tiny"), strict=False):
        r, j = divmod(slot, 2)
        cols = slice(j * BLOCK, (j + 1) * BLOCK)
        pos = j * BLOCK + randint(g, 0, BLOCK - 1)
        if kind == "zero":
            x[r, cols] = 0.0
            continue
        peak = 2.0**e if kind != "tiny" else 1.5 * 2.0**-126
        x[r, cols] = x[r, cols] / x[r, cols].abs().max() * (peak / 2)  # all below peak / 2
        x[r, pos] = peak * choice(g, (1.0, -1.0))
        if kind == "below":
            x[r, pos] = torch.nextafter(x[r, pos], torch.tensor(0.0))
    return x


def _codes_explain(x: torch.Tensor, m: Mismatch, scale: float, grid, what: str) -> str:
    y = float(torch.tensor(float(x[m.index])) / torch.tensor(scale))
    return f"x = {num(x[m.index])}, {what} = {num(scale)}, x / {what} = {grid_rounding(y, grid)}"


def _mxfp4_explain(args, m: Mismatch) -> str:
    (x,) = args
    codes, scales = quantized(x, "mxfp4")
    r, k = m.index
    j = k // BLOCK if m.output == "codes" else k
    head = f"{_mx_block(x, r, j, BLOCK)}; X = 2^(that - 2) = {num(scales[r, j])}"
    if m.output != "codes":
        return head
    return head + "; " + _codes_explain(x, m, float(scales[r, j]), FP4, "X")


@task("mxfp4_quantize", "mxfp4_quantize", points=3, reference=lambda x: quantized(x, "mxfp4"),
      implements=("qlab.quantize", "qlab.scales.e8m0"),
      compare=exact(names=("codes", "scales"), explain=_mxfp4_explain),
      signature="mxfp4_quantize(x) -> (codes uint8 E2M1 (R, K), scales float32 (R, K // 32))")
def _mxfp4_cases(g: torch.Generator):
    cases = [(_random_blocks(g),) for _ in range(2)]
    cases.append((_mx_edges(g),))
    return cases


def _mx_edges(g: torch.Generator) -> torch.Tensor:
    """(2, 4 blocks): E2M1 ties x = t X (block amax 6 X, so X = 2^p exactly), a saturating
    block (amax 7.5 X), amax one ulp below 2^e (log2 rounds up), an all-zero block."""
    x = weights(g, (2, 4 * BLOCK), scale=0.5)
    p = randint(g, -6, 4)
    ties = torch.tensor(E2M1_TIES) * torch.tensor([[1.0], [-1.0]])  # shape: (2, 7)
    x[0, :BLOCK] = torch.empty(BLOCK).uniform_(-5.9, 5.9, generator=g)
    x[0, :14] = ties.reshape(-1)
    x[0, 14] = 6.0
    x[0, :BLOCK] *= 2.0**p  # exact scaling: the ties stay ties
    x[0, BLOCK : 2 * BLOCK] = torch.empty(BLOCK).uniform_(-7.5, 7.5, generator=g) * 2.0**p
    x[0, BLOCK + randint(g, 0, BLOCK - 1)] = 7.5 * 2.0**p  # saturates to 6 X
    e = choice(g, LOG2_ROUNDS_UP)
    x[1, :BLOCK] *= 2.0**e / (2 * float(x[1, :BLOCK].abs().max()))
    x[1, randint(g, 0, BLOCK - 1)] = torch.nextafter(torch.tensor(2.0**e), torch.tensor(0.0))
    j = randint(g, 1, 3)
    x[1, j * BLOCK : (j + 1) * BLOCK] = 0.0
    return x


_NV = ("codes", "scales", "tensor_scale")


def _nvfp4_explain(args, m: Mismatch) -> str:
    (x,) = args
    _, bs, ts = quantized(x, "nvfp4", fields=_NV)
    head = f"amax = {num(x.abs().max())}, ts = amax / 2688 = {num(ts)}"
    if m.output == "tensor_scale":
        return head
    r, k = m.index
    j = k // NV_BLOCK if m.output == "codes" else k
    bamax = x[r, j * NV_BLOCK : (j + 1) * NV_BLOCK].abs().max()
    hp = (bamax / 6.0) / ts
    head += (
        f"; row {r}, block {j}: block amax = {num(bamax)}, (block amax / 6) / ts = {num(hp)}, "
        f"clamped to [2^-6, 448] and rounded to E4M3: bs = "
        + grid_rounding(float(hp.clamp(2.0**-6, 448.0)), FP8)
    )
    if m.output != "codes":
        return head
    return head + "; " + _codes_explain(x, m, float(ts * bs[r, j]), FP4, "(ts * bs)")


@task("nvfp4_quantize", "nvfp4_quantize", points=3,
      implements=("qlab.quantize", "qlab.scales.nvfp4"),
      reference=lambda x: quantized(x, "nvfp4", fields=_NV),
      compare=exact(names=("codes", "block_scales", "tensor_scale"), explain=_nvfp4_explain),
      signature="nvfp4_quantize(x) -> (codes uint8 (R, K), block scales (R, K // 16), ts 0-d)")
def _nvfp4_cases(g: torch.Generator):
    cases = []
    for _ in range(2):
        rows, k = randint(g, 1, 4), NV_BLOCK * randint(g, 1, 6)
        cases.append((weights(g, (rows, k), outliers=bool(randint(g, 0, 1))),))
    cases.append((_nv_ties(g),))
    cases.append((_nv_traps(g),))
    return cases


def _nv_ties(g: torch.Generator) -> torch.Tensor:
    """ts = 2^p exactly (amax = 2688 * 2^p, block 0). Blocks 1 and 3: bs_hp exactly halfway
    between two E4M3 values, the even code below (RNE rounds down) resp. above (up) (V3).
    Block 2: an exact E4M3 bs with elements t * ts * bs on every E2M1 tie, both signs (V6)."""
    p = randint(g, -10, -2)
    ts = 2.0**p
    x = weights(g, (1, 4 * NV_BLOCK), scale=100 * ts)
    x[0, :NV_BLOCK] = x[0, :NV_BLOCK].clamp(-2000 * ts, 2000 * ts)
    x[0, randint(g, 0, NV_BLOCK - 1)] = 2688 * ts * choice(g, (1.0, -1.0))  # bs 448
    v = FP8.values[(FP8.values >= 0.25) & (FP8.values <= 200)]  # neighbours, ascending
    even_low = (FP8.encode(v[:-1]) % 2 == 0).nonzero().flatten()
    odd_low = (FP8.encode(v[:-1]) % 2 == 1).nonzero().flatten()
    for j, lows in ((1, even_low), (3, odd_low)):
        i = int(lows[randint(g, 0, lows.numel() - 1)])
        mid = (float(v[i]) + float(v[i + 1])) / 2  # an E4M3 tie; 6 * mid * ts is exact
        cols = slice(j * NV_BLOCK, (j + 1) * NV_BLOCK)
        x[0, cols] = x[0, cols] / x[0, cols].abs().max() * (5 * mid * ts)
        x[0, j * NV_BLOCK + randint(g, 0, NV_BLOCK - 1)] = 6 * mid * ts
    bs = float(v[randint(g, 0, v.numel() - 1)])
    ties = torch.tensor([*E2M1_TIES, *(-t for t in E2M1_TIES), 6.0, -4.0]) * (ts * bs)
    x[0, 2 * NV_BLOCK : 3 * NV_BLOCK] = ties
    return x


def _nv_traps(g: torch.Generator) -> torch.Tensor:
    """(2, 4 blocks) around a tensor amax for which (amax / 6) / 448 != amax / 2688 (V1).
    Blocks (0, 0) and (0, 1): block amaxes for which block_amax / (6 ts), resp.
    (block_amax / ts) / 6, round to another E4M3 bs than (block_amax / 6) / ts (V2).
    Block (0, 2): elements for which (x / ts) / bs gives another E2M1 code than
    x / (ts * bs) (V5). Block (1, 0) all zeros, block (1, 1) tiny: bs_hp < 2^-6 (V4)."""
    amax, ts, order = _order_traps(g)
    x = weights(g, (2, 4 * NV_BLOCK), scale=float(amax) / 8).clamp(-amax / 2, amax / 2)
    x[1, 3 * NV_BLOCK + randint(g, 0, NV_BLOCK - 1)] = amax * choice(g, (1.0, -1.0))
    for j, b in enumerate(order):
        x[0, j * NV_BLOCK : (j + 1) * NV_BLOCK] *= float(b) / (2 * float(amax))
        x[0, j * NV_BLOCK + randint(g, 0, NV_BLOCK - 1)] = b  # the block amax
    split = torch.empty(0)
    while split.numel() == 0:  # bs must not be a power of two, else the two orders agree
        bs = choice(g, _NOT_POW2)
        bamax = 6.0 * bs * ts
        split = rounding_splits(
            lambda v, bs=bs: FP4.encode(v / (ts * bs)),
            lambda v, bs=bs: FP4.encode((v / ts) / bs),
            FP4.values[FP4.values > 0] * (ts * bs),
            g,
        )
        split = split[split < bamax][:8]
    x[0, 2 * NV_BLOCK : 3 * NV_BLOCK] *= float(bamax) / float(amax)  # below bamax / 2
    x[0, 2 * NV_BLOCK + 1 : 2 * NV_BLOCK + 1 + split.numel()] = split
    x[0, 2 * NV_BLOCK] = bamax  # the block amax: bs = E4M3((bamax / 6) / ts) = bs
    x[1, :NV_BLOCK] = 0.0
    x[1, NV_BLOCK : 2 * NV_BLOCK] = weights(g, (NV_BLOCK,), scale=float(ts) * 1e-3)
    return x


def _order_traps(g: torch.Generator):
    """(amax, ts, [b1, b2]): (amax / 6) / 448 and amax * fp32(1 / 2688) both differ from
    amax / 2688, and block amaxes b1, b2 for
    which b / (6 ts), resp. (b / ts) / 6, round to another E4M3 than (b / 6) / ts."""
    wrong = (lambda b, ts: b / (6.0 * ts), lambda b, ts: (b / ts) / 6.0)
    for _ in range(1000):
        amax = torch.empty(()).uniform_(1.0, 100.0, generator=g)
        ts = amax / 2688.0
        if (amax / 6.0) / 448.0 == ts or amax * torch.tensor(1.0 / 2688.0) == ts:
            continue
        centres = FP8.values[(FP8.values > 2.0**-6) & (FP8.values < 220)] * (6.0 * ts)
        hits = [
            rounding_splits(
                lambda b, ts=ts: FP8.encode((b / 6.0) / ts),
                lambda b, ts=ts, w=w: FP8.encode(w(b, ts)),
                centres,
                g,
            )
            for w in wrong
        ]
        if all(h.numel() for h in hits):
            return amax, ts, [h[0] for h in hits]
    raise RuntimeError("no tensor amax with both E4M3 order traps; widen the search")
