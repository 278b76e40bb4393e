"""Chapter 16 (KV cache): KIVI-style per-channel keys with a full-precision window, and
the static-scale FP8 cache of vLLM's layout, both bit-exact with qlab.kv.

Spec clauses, and the fixed case (present on every seed) where breaking each one changes
the answer (tests/grading/mutants_ch16.py holds a mutant per clause):

kivi_keys(k float32 (S, D), bits, chunk, window) -> float32 (S, D)
  K1 one scale and zero point per CHANNEL per chunk (not per token) ....... "edges"
  K2 chunks of `chunk` tokens start at position 0 .......................... "edges"
  K3 quantized: every whole chunk holding a position < S - window; the
     chunk straddling the window gets its range from all its tokens ........ "edges"
  K4 the last `window` tokens come back unchanged (the END of the cache) ... every case
  K5 S <= window: nothing is quantized .................................... "short"
  K6 the range includes 0: lo = min(min, 0), hi = max(max, 0) .............. "edges"
  K7 s = fp16((hi - lo) / (2^b - 1)); codes divide by the STORED s ......... "edges"
  K8 z = round(-lo / s), half to even ..................................... "edges"
  K9 q = round(x / s) + z: x / s rounded half to even, before adding z ..... "edges"
  K10 q clamped to [0, 2^b - 1] (a tie can reach 2^b) ..................... "edges"
  K11 a true division x / s, not x * (1 / s) .............................. "edges"
  K12 x_hat = s * (q - z) in float32 ...................................... "edges"
  K13 an all-zero channel chunk: s = 0, divide by 1, reads back 0 .......... "edges"
  (K7, K9, K11, K12 pin qlab.kv's order on purpose, bit-exact with what the chapter's
  model reads: the spec's first sentence says so, and the feedback names x * (1 / s), the
  float32 scale, the straddling chunk or the window where they differ. A zero point shows
  in what attention reads only where the clamp acts, as x_hat = s * clamp(round(x / s), -z,
  2^b - 1 - z): K8's case is a chunk whose fp16 scale, rounded down, puts its top code on
  the clamp.)
fp8_kv_cache(calib (H, N, D), x (H, S, D), per_head) -> (scale, codes uint8, x_hat float32)
  P1 the scale comes from the calibration batch, never from x (static) .... "edges"
  P2 per_head: amax over each head's (N, D), scale (H, 1, 1); else 0-d .... "heads"
  P3 scale = amax / 448, a float32 division ................................ "edges"
  P4 an all-zero calibration head gets scale 1 ............................. "heads"
  P5 y = x / scale, a true division (not x * (1 / scale), x * 448 / amax) . "edges"
  P6 E4M3 round half to even .............................................. "heads"
  P7 |y| > 448 saturates to +-448 (codes 0x7E, 0xFE), never NaN ............ "edges"
  P8 x_hat = E4M3(code) * scale, one float32 multiply ...................... every case
  (P3, P5, P8 pin qlab.kv's order on purpose, as K7-K12.)
kv_budget(n_layers, n_heads, n_kv_heads, head_dim, n_params, weight_bits, memory_bytes,
          bits, window, context) -> (bits_per_element, bytes_per_token, sequences)
  B1 K and V are both cached: x 2 ........................................ every case
  B2 only the KV heads are cached (n_kv_heads < n_heads: GQA) ............. every case
  B3 a quantized element costs bits + (16 + bits) / 32 (fp16 scale and a
     bits-bit zero point per 32) ........................................... every case
  B4 the min(window, context) recent tokens cost 16 bits, averaged over
     the context .......................................................... "short"
  B5 bytes = bits / 8 .................................................... every case
  B6 free memory = memory_bytes - n_params * weight_bits / 8 .............. every case
  B7 sequences = floor(free / (bytes_per_token * context)), 0 when the
     weights do not fit (never negative) .................................. "tight", "full"
  (floats compared with rtol 1e-12: the order of float64 operations is not the lesson; in
  every case but "full" (weights beyond memory: 0 sequences) free / (bytes per sequence) has
  a fractional part in [0.1, 0.9], so floor is not decided by the last bit)
"""

from __future__ import annotations

import torch

import qlab
from qlab.cost import Device, ModelConfig, kv_cache_bytes_per_token, max_concurrent_sequences
from qlab.grading.registry import Mismatch, close, exact, tasks_for
from qlab.grading.tasks._inputs import choice, randint, reciprocal_trap, rounding_splits, weights
from qlab.grading.tasks._spec import div32, grid_rounding, int_rounding, num
from qlab.kv import (
    E4M3_MAX,
    KVScheme,
    _CacheQuantizer,
    _fp8_static,
    bits_per_element,
    fp8_static_scale,
)

task = tasks_for("16_kv_cache")
E4M3 = qlab.formats.get("fp8_e4m3fn")
TIES = (0.5, 2.5, -1.5, -0.5, 1.5, -2.5)  # RNE: 0, 2, -2, -0, 2, -2; half-up/away differ
# E4M3 ties (chapter 04's): 1.0625 -> 1.0 and 15.5 -> 16 (even codes), 2^-10 -> 0, both signs
E4M3_TIES = (1.0625, -1.1875, 15.5, -(2.0**-10), 3 * 2.0**-10, -1.0625, 50.0, -50.0)


# --------------------------------------------------------------------------- KIVI keys


def _kivi_reference(k: torch.Tensor, bits: int, chunk: int, window: int) -> torch.Tensor:
    """What attention reads from qlab.kv's per-channel key cache (the kivi schemes' rule)."""
    scheme = KVScheme(name=f"kivi{bits}", element=f"uint{bits}_asym", key_axis="channel",
                      group=chunk, window=window)
    k4 = k[None, None]  # shape: (1, 1, S, D)
    v = torch.zeros(1, 1, k.shape[0], chunk)  # values are not graded here
    return _CacheQuantizer(scheme)(k4, k4, v)[1][0, 0]


def _old_and_end(s: int, chunk: int, window: int) -> tuple[int, int]:
    """(positions older than the window, end of the last chunk holding one of them)."""
    old = max(s - window, 0)
    return old, -(-old // chunk) * chunk


def _chunk_column(col: torch.Tensor, bits: int, z_round=torch.round) -> torch.Tensor:
    """x_hat of one channel chunk (for the trap searches below; the reference is qlab's)."""
    levels = 2**bits - 1
    lo, hi = col.min().clamp(max=0.0), col.max().clamp(min=0.0)
    s = ((hi - lo) / levels).half().float()
    s1 = torch.where(s == 0, torch.ones_like(s), s)
    z = torch.clamp(z_round(-lo / s1), 0, levels)
    return s * (torch.clamp(torch.round(col / s1) + z, 0, levels) - z)


def _code_ties(g: torch.Generator, bits: int, n: int) -> torch.Tensor:
    """Range [-z s, (levels - z) s], s a power of two, z ODD: x / s = t + 0.5 ties round to
    even before z is added (round(x / s + z) differs) and floor differs."""
    levels = 2**bits - 1
    z = 2 * randint(g, 1, (levels - 4) // 2) + 1
    step = 2.0 ** randint(g, -5, 1)
    col = torch.randint(-2 * z, 2 * (levels - z) + 1, (n,), generator=g).float() * (step / 2)
    col[:8] = torch.tensor([-z, levels - z, *TIES]) * step
    return col


def _clamp_tie(g: torch.Generator, bits: int, n: int) -> torch.Tensor:
    """-lo / s = k + 0.5 with k odd: z = k + 1, and hi / s rounds up to levels - k, so the
    code reaches 2^b and the clamp to 2^b - 1 acts."""
    levels = 2**bits - 1
    k = 2 * randint(g, 0, (levels - 3) // 2) + 1
    step = 2.0 ** randint(g, -5, 1)
    lo, hi = -(k + 0.5) * step, (levels - k - 0.5) * step
    col = lo + (hi - lo) * torch.rand(n, generator=g)
    col[0], col[1] = lo, hi
    return col


def _z_tie(g: torch.Generator, bits: int, n: int) -> torch.Tensor:
    """-lo / s = k + 0.5 exactly (k even: half to even keeps k, half up gives k + 1) with a
    range a little wider than levels * s (its fp16 scale rounded down), so hi / s rounds to
    levels - k and the one-higher zero point pushes the top code onto the clamp."""
    levels = 2**bits - 1
    for _ in range(2000):
        k = 2 * randint(g, 0, (levels - 3) // 2)
        s16 = torch.tensor(1 + randint(g, 1, 1023) / 1024).half().float() * 2.0 ** randint(g, -6, 0)
        lo = -(k + 0.5) * s16
        span = levels * s16 * (1 + float(torch.rand((), generator=g)) * 2.0**-12)
        col = lo + span * torch.rand(n, generator=g)
        col[0], col[1] = lo, lo + span
        up = _chunk_column(col, bits, lambda v: torch.floor(v + 0.5))
        if not torch.equal(_chunk_column(col, bits), up):
            return col
    raise RuntimeError("no zero-point tie found")


def _reciprocal_column(g: torch.Generator, bits: int, n: int) -> torch.Tensor:
    """Range [-z s, (levels - z) s] with s a float16 at which x = +-(k + 0.5) s divides to
    an exact tie while x * (1 / s) rounds to the other neighbour."""
    levels = 2**bits - 1
    k = randint(g, 1, min(15, (levels - 2) // 2))
    s = reciprocal_trap(g, k) * 2.0 ** randint(g, -6, 0)
    z = randint(g, k + 1, levels - k - 1)
    lo, hi = -z * s, (levels - z) * s
    col = (lo + (hi - lo) * torch.rand(n, generator=g)).clamp(lo, hi)
    col[0], col[1], col[2], col[3] = lo, hi, (k + 0.5) * s, -(k + 0.5) * s
    return col


def _straddle(g: torch.Generator, bits: int, n: int) -> torch.Tensor:
    """A range whose scale is not a float16: an x whose code from the float32 scale differs."""
    levels = 2**bits - 1
    for _ in range(500):
        lo = -torch.empty(()).uniform_(0.2, 2.0, generator=g)
        hi = torch.empty(()).uniform_(0.2, 2.0, generator=g)
        s32 = (hi - lo) / levels
        s16 = s32.half().float()
        t = randint(g, 1, int(hi / s16) - 1)
        x = (t + 0.5) * (s16 + s32) / 2  # between the two tie points
        if torch.round(x / s16) != torch.round(x / s32):
            col = lo + (hi - lo) * torch.rand(n, generator=g)
            col[0], col[1], col[2] = lo, hi, x
            return col
    raise RuntimeError("no float16 straddle found")


def _fp16_product(g: torch.Generator, bits: int, n: int) -> torch.Tensor:
    """s with all 11 significant bits and codes far from z: s * (q - z) needs more bits
    than float16 has (a float16 product rounds)."""
    levels = 2**bits - 1
    s = (1 + (2 * randint(g, 0, 511) + 1) / 1024) * 2.0 ** randint(g, -6, -2)
    z = randint(g, 1, levels // 4)
    col = torch.randint(-z, levels - z + 1, (n,), generator=g).float() * s
    col[0], col[1] = -z * s, (levels - z) * s
    return col


def _kivi_edges(g: torch.Generator):
    """chunk 16, bits 6..8, 3 old chunks and a straddling one. Chunk 0's channels (shuffled)
    hold one trap each: code ties (z odd), the clamp tie, the zero-point tie, the reciprocal,
    the fp16 straddle, the fp16 product, all > 0, all equal, all < 0, all zero; the other
    channels have ranges 0.05x..20x (per token differs). The window starts 5..11 tokens into
    chunk 3, and one channel's extreme sits in that chunk's window part (K3)."""
    bits, chunk = randint(g, 6, 8), 16
    traps = [_code_ties, _clamp_tie, _z_tie, _reciprocal_column, _straddle, _fp16_product]
    cols = [f(g, bits, chunk) for f in traps]
    pos = weights(g, (chunk,), scale=0.5).abs() + 0.1
    cols += [pos, torch.full((chunk,), float(pos[0])), -pos.flip(0), torch.zeros(chunk)]
    old, window = 3 * chunk + randint(g, 5, 11), chunk + randint(g, 0, 8)
    d = len(cols) + 6
    k = weights(g, (old + window, d), scale=0.3)
    k[:, len(cols):] *= torch.tensor([1.0, 8.0, 0.05, 1.0, 20.0, 0.5])  # outlier channels
    k[:chunk, : len(cols)] = torch.stack(cols, dim=1)
    k[old + 1, -1] = 50.0  # in the window part of the straddling chunk: the channel's extreme
    return k[:, torch.randperm(d, generator=g)], bits, chunk, window


def _kivi_cases(g: torch.Generator):
    cases = [_kivi_edges(g)]
    for _ in range(2):
        chunk = choice(g, (4, 8, 16))
        window = chunk * randint(g, 1, 2) + randint(g, 0, chunk - 1)
        s = randint(g, window + 1, window + 4 * chunk)
        k = weights(g, (s, randint(g, 3, 12)), outliers=True)
        k = k * torch.logspace(-1, 1, k.shape[1])[torch.randperm(k.shape[1], generator=g)]
        cases.append((k, randint(g, 2, 8), chunk, window))
    chunk = choice(g, (4, 8))  # "short": S < window - chunk, nothing quantized
    window = 2 * chunk + randint(g, 0, chunk - 1)
    cases.append((weights(g, (randint(g, 1, window - chunk - 1), 5)), randint(g, 2, 4), chunk,
                  window))
    return cases


def _kivi_explain(args, m: Mismatch) -> str:
    k, bits, chunk, window = args
    t, c = m.index
    s_len = k.shape[0]
    old, end = _old_and_end(s_len, chunk, window)
    if t >= old:
        return (f"position {t} is in the window (the last {window} of S = {s_len} tokens, "
                f"from position {old}): returned unchanged, x = {num(k[t, c])}")
    j = t // chunk
    col = k[j * chunk : (j + 1) * chunk, c]
    levels = 2**bits - 1
    lo, hi = float(col.min().clamp(max=0.0)), float(col.max().clamp(min=0.0))
    s32 = (torch.tensor(hi) - lo) / levels
    s = float(s32.half())
    head = (f"position {t}, channel {c}: chunk {j} = positions {j * chunk}..{(j + 1) * chunk - 1}"
            f" of channel {c}")
    if end > old and j == end // chunk - 1:
        head += (f" (it straddles the window, which starts at {old}: its range comes from "
                 "all its tokens, the window's included)")
    head += (f"; lo = min(., 0) = {num(lo)}, hi = max(., 0) = {num(hi)}, (hi - lo) / {levels} "
             f"= {num(s32)}, stored as float16: s = {num(s)}")
    if s == 0:
        return head + " (an all-zero channel chunk: divide by 1, z = 0, reads back 0)"
    z = min(max(round(div32(-lo, s)), 0), levels)
    x = float(k[t, c])
    q = min(max(round(div32(x, s)) + z, 0), levels)
    note = (f"{head}; -lo / s = {int_rounding(div32(-lo, s))}, so z = {z}; x = {num(x)}, "
            f"x / s = {int_rounding(div32(x, s))}, + z, clamp to [0, {levels}]: q = {q}; "
            f"x_hat = s * (q - z) = {num(torch.tensor(s) * (q - z))} (float32)")
    recip = float(torch.tensor(x) * (1 / torch.tensor(s)))
    if round(recip) != round(div32(x, s)):
        note += f" (x * (1 / s) = {num(recip)} rounds otherwise: divide)"
    if round(div32(x, float(s32))) != round(div32(x, s)):
        note += f" (x / the unrounded float32 scale = {num(div32(x, float(s32)))}: use the fp16 s)"
    return note


task("kivi_keys", "kivi_keys", points=3, reference=_kivi_reference,
     implements=("qlab.quantize", "qlab.fake_quantize", "qlab.scales.minmax",
                 "qlab.kv.quantize_keys", "qlab.kv.quantize_values", "qlab.kv.quantize_cache",
                 "qlab.kv._CacheQuantizer.__call__", "qlab.kv._CacheQuantizer._keys"),
     compare=exact(explain=_kivi_explain),
     signature="kivi_keys(k float32 (S, D), bits, chunk, window) -> float32 (S, D)"
     )(_kivi_cases)


# --------------------------------------------------------------------------- FP8 cache


def _fp8_reference(calib: torch.Tensor, x: torch.Tensor, per_head: bool):
    scale = fp8_static_scale(calib[None], "head" if per_head else "tensor")
    return scale, E4M3.encode(x / scale), _fp8_static(x, scale)


def _division_hits(amax: torch.Tensor, g: torch.Generator) -> list[torch.Tensor]:
    """Per wrong order (x * (1 / s), x * 448 / amax, x / amax * 448, s = amax * (1 / 448)),
    values near E4M3 ties whose code differs from E4M3(x / s), s = amax / 448."""
    s = amax / E4M3_MAX
    centres = E4M3.values[(E4M3.values > 0.5) & (E4M3.values < 440)] * s
    wrong = (lambda v: E4M3.encode(v * (1.0 / s)),
             lambda v: E4M3.encode(v * E4M3_MAX / amax),
             lambda v: E4M3.encode(v / amax * E4M3_MAX),
             lambda v: E4M3.encode(v / (amax * (1.0 / E4M3_MAX))))
    return [rounding_splits(lambda v: E4M3.encode(v / s), w, centres, g) for w in wrong]


def _division_trap(g: torch.Generator) -> tuple[float, torch.Tensor]:
    """(amax, xs): amax / 448 differs from amax * fp32(1 / 448), and values xs whose codes
    differ between x / s and each wrong order of _division_hits."""
    for _ in range(500):
        amax = torch.empty(()).uniform_(1.0, 8.0, generator=g)
        if amax / E4M3_MAX == amax * (1.0 / E4M3_MAX):
            continue
        hits = _division_hits(amax, g)
        if all(h.numel() for h in hits):
            return float(amax), torch.cat([h[:4] for h in hits])
    raise RuntimeError("no FP8 division trap found")


def _fp8_edges(g: torch.Generator):
    """Per tensor, H = 2: the calibration amax is the division trap's (P3, P5), x holds its
    values, and values beyond the calibration amax (saturate, P1, P7) and -0.0."""
    amax, xs = _division_trap(g)
    calib = weights(g, (2, 24, 8), scale=amax / 4).clamp(-amax * 0.99, amax * 0.99)
    calib[randint(g, 0, 1), randint(g, 0, 23), randint(g, 0, 7)] = amax * choice(g, (1.0, -1.0))
    x = weights(g, (2, 10, 8), scale=amax / 3).clamp(-amax, amax)
    flat = x.view(-1)
    flat[: xs.numel()] = xs
    flat[40:46] = torch.tensor([1.3 * amax, -2.0 * amax, 5.0 * amax, -9.0 * amax, 100.0, -0.0])
    return calib, x, False


def _fp8_heads(g: torch.Generator):
    """Per head, H = 4: heads of very different ranges (P2), one all-zero calibration head
    (scale 1) whose x is not zero (P4), and exact E4M3 ties at a power-of-two head scale
    (P6)."""
    h = 4
    ranges = torch.tensor([0.05, 1.0, 30.0, 0.0])[torch.randperm(h, generator=g)]
    calib = weights(g, (h, 20, 8), scale=1.0) * ranges[:, None, None]
    p = randint(g, -4, 0)
    two = int(torch.nonzero(ranges == 1.0)[0, 0])
    calib[two] = calib[two].clamp(-400 * 2.0**p, 400 * 2.0**p)
    calib[two, 0, 0] = 448 * 2.0**p  # head scale 2^p exactly
    x = weights(g, (h, 12, 8), scale=1.0) * (ranges[:, None, None] + 0.5)
    x[two, 0, : len(E4M3_TIES)] = torch.tensor(E4M3_TIES) * 2.0**p
    return calib, x, True


def _fp8_cases(g: torch.Generator):
    cases = [_fp8_edges(g), _fp8_heads(g)]
    for per_head in (False, True):
        h, d = randint(g, 1, 4), choice(g, (4, 8, 16))
        calib = weights(g, (h, randint(g, 4, 32), d), outliers=True)
        x = weights(g, (h, randint(g, 1, 24), d), outliers=True)
        cases.append((calib, x, per_head))
    return cases


def _fp8_explain(args, m: Mismatch) -> str:
    calib, x, per_head = args
    scale = fp8_static_scale(calib[None], "head" if per_head else "tensor")
    if per_head:
        hd = m.index[0] if m.index else 0
        amax, s = calib[hd].abs().max(), scale.reshape(-1)[hd]
        head = f"head {hd}: amax = max|calib[{hd}]| = {num(amax)}"
    else:
        amax, s = calib.abs().max(), scale
        head = f"amax = max|calib| (all heads) = {num(amax)}"
    if amax == 0:
        head += ", an all-zero calibration: scale = 1"
    else:
        head += f", scale = amax / 448 = {num(s)} (float32)"
        if amax * (1.0 / E4M3_MAX) != s:
            head += f" (amax * (1 / 448) = {num(amax * (1.0 / E4M3_MAX))} differs: divide)"
    if m.output == "scale":
        return head + "; the scale comes from calib, never from x"
    v = x[m.index]
    y = v / s
    code = int(E4M3.encode(y.reshape(1))[0])
    note = f"{head}; x = {num(v)}, x / scale = {grid_rounding(float(y), E4M3)}"
    if E4M3.encode((v * (1 / s)).reshape(1))[0] != code:
        note += f" (x * (1 / scale) = {num(v * (1 / s))} encodes otherwise: divide)"
    if m.output == "x_hat":
        e = float(E4M3.decode(torch.tensor([code], dtype=torch.uint8))[0])
        note += f"; x_hat = E4M3 value {num(e)} * scale = {num(e * s)} (one float32 multiply)"
    return note


task("fp8_kv_cache", "fp8_kv_cache", points=3, reference=_fp8_reference,
     implements=("qlab.quantize", "qlab.fake_quantize", "qlab.kv.fp8_static_scale",
                 "qlab.kv._fp8_static", "qlab.kv.calibrate_fp8_scales",
                 "qlab.formats.minifloat.Minifloat.encode",
                 "qlab.formats.minifloat.Minifloat.encode_generic"),
     compare=exact(names=("scale", "codes", "x_hat"), explain=_fp8_explain),
     signature="fp8_kv_cache(calib (H, N, D), x (H, S, D), per_head) -> "
               "(scale float32 () or (H, 1, 1), codes uint8 (H, S, D), x_hat float32 (H, S, D))"
     )(_fp8_cases)


# --------------------------------------------------------------------------- budget


def _budget_reference(n_layers, n_heads, n_kv_heads, head_dim, n_params, weight_bits,
                      memory_bytes, bits, window, context):
    """qlab.kv's bits per element of the kivi{bits} layout (with this window), chapter 00's
    calculator (qlab.cost) for the bytes per token and the sequences that fit."""
    scheme = KVScheme(name=f"kivi{bits}", element=f"uint{bits}_asym", key_axis="channel",
                      window=window)
    bpe = bits_per_element(scheme, head_dim=head_dim, seq_len=context)
    model = ModelConfig("exercise", n_params, n_layers, n_kv_heads, head_dim, n_heads)
    device = Device("exercise", memory_bytes, 1.0)
    return (bpe, kv_cache_bytes_per_token(model, bpe),
            max_concurrent_sequences(model, weight_bits, device, context, kv_bits=bpe))


def _budget_case(g: torch.Generator, kind: str = "") -> tuple:
    """A GQA model; memory = weights + (n + f) sequences' caches, f in [0.1, 0.9] ("tight":
    [0.6, 0.9], where round gives n + 1; "full": weights beyond memory, 0 sequences)."""
    n_kv_heads, head_dim = choice(g, (1, 2, 4, 8)), choice(g, (64, 128))
    n_heads = n_kv_heads * choice(g, (2, 4, 8))
    n_layers, bits, window = randint(g, 2, 80), randint(g, 2, 8), choice(g, (32, 64, 128))
    context = randint(g, 1, window - 1) if kind == "short" else randint(g, window + 1, 32768)
    n_params = float(randint(g, 1, 700)) * 1e8
    weight_bits = choice(g, (4, 8, 16))
    args = [n_layers, n_heads, n_kv_heads, head_dim, n_params, weight_bits, 0.0, bits, window,
            context]
    per_seq = _budget_reference(*args[:6], 1.0, *args[7:])[1] * context
    weights = n_params * weight_bits / 8
    lo = 0.6 if kind == "tight" else 0.1
    frac = lo + (0.9 - lo) * float(torch.rand((), generator=g))
    args[6] = weights + per_seq * (randint(g, 1, 200) + frac)
    if kind == "full":
        args[6] = weights * (0.5 + 0.4 * float(torch.rand((), generator=g)))
    return tuple(args)


def _budget_cases(g: torch.Generator):
    return [_budget_case(g, kind) for kind in ("", "short", "tight", "full", "")]


def _budget_explain(args, m: Mismatch) -> str:
    n_layers, n_heads, n_kv_heads, head_dim, n_params, weight_bits, memory, bits, window, ctx = args
    bpe, per_token, seqs = _budget_reference(*args)
    n_float = min(window, ctx)
    free = memory - n_params * weight_bits / 8
    return (f"quantized elements: {bits} + (16 + {bits}) / 32 = {bits + (16 + bits) / 32!r} bits; "
            f"{n_float} of {ctx} tokens at 16 bits: {bpe!r} bits per element; {n_layers} "
            f"layers x {n_kv_heads} KV heads (not the {n_heads} query heads) x {head_dim} x 2 "
            f"(K and V) x {bpe!r} / 8 = {per_token!r} bytes per token; free = {memory!r} - "
            f"{n_params!r} x {weight_bits} / 8 = {free!r} bytes; floor(free / ({per_token!r} x "
            f"{ctx})) = {seqs} sequences (0 if negative)")


task("kv_budget", "kv_budget", points=2, reference=_budget_reference,
     implements=("qlab.kv.bits_per_element", "qlab.cost.kv_cache_bytes_per_token",
                 "qlab.cost.max_concurrent_sequences", "qlab.cost.bits_per_weight"),
     compare=close(rtol=1e-12, names=("bits_per_element", "bytes_per_token", "sequences"),
                   explain=_budget_explain),
     signature="kv_budget(n_layers, n_heads, n_kv_heads, head_dim, n_params, weight_bits, "
               "memory_bytes, bits, window, context) -> (float, float, int)"
     )(_budget_cases)
