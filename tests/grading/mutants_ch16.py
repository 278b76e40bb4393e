"""Known-wrong implementations for chapter 16 (KV cache), merged into grading_bank.MUTANTS:
one or more per spec clause of qlab/grading/tasks/ch16_kv_cache.py (K1-K13, P1-P8, B1-B7),
among them the variants students write (per token, window at the start, floor, the
straddling chunk's range from its old tokens only, NaN instead of saturation,
x * 448 / amax, the query heads instead of the KV heads, round instead of floor). Each is
the solution cell of solutions/16_kv_cache.ipynb with one textual change (or, where no small
edit says it, a whole cell), and must fail `check` on every seed (test_grading_check.py runs
them on several)."""

from __future__ import annotations

from mutant_edits import build_mutants

OLD = "old = max(k.shape[0] - window, 0)  # positions older than the window"
END = "end = -(-old // chunk) * chunk  # the whole chunks that hold them"
BLOCKS = "k[:end].reshape(end // chunk, chunk, k.shape[1])"
LO = "lo = blocks.amin(dim=1).clamp(max=0.0)"
HI = "hi = blocks.amax(dim=1).clamp(min=0.0)"
S = "s = ((hi - lo) / levels).half().float()  # the stored float16 scale"
S_DIV = "s_div = torch.where(s == 0, torch.ones_like(s), s)"
Z = "torch.round(-lo / s_div)"
X_S = "torch.round(blocks / s_div[:, None]) + z[:, None]"
Q = f"q = torch.clamp({X_S}, 0, levels)"
DQ = "(s[:, None] * (q - z[:, None]))"
WIN = "k_hat[old:] = k[old:]"

AMAX_HEAD = "amax = calib.abs().amax(dim=(1, 2))[:, None, None]"
AMAX_ALL = "amax = calib.abs().amax()"
SCALE = "scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))"
Y = "y = (x / scale).clamp(-448, 448)"
READ = "e4m3.float() * scale"

QUANT = "quantized = bits + (16 + bits) / 32"
N_FLOAT = "n_float = min(window, context)"
BPE = "bits_per_element = ((context - n_float) * quantized + n_float * 16) / context"
PER_TOKEN = "bytes_per_token = n_layers * n_kv_heads * head_dim * 2 * bits_per_element / 8"
FREE = "free = memory_bytes - n_params * weight_bits / 8"
SEQS = "sequences = max(0, math.floor(free / (bytes_per_token * context)))"

# the range of the straddling chunk from its old tokens only: chunks cut at the window
OLD_TOKENS_ONLY = '''
def kivi_keys(k: torch.Tensor, bits: int, chunk: int, window: int) -> torch.Tensor:
    levels = 2**bits - 1
    old = max(k.shape[0] - window, 0)
    k_hat = k.clone()
    for start in range(0, old, chunk):
        blk = k[start:min(start + chunk, old)]  # stops at the window
        lo = blk.amin(dim=0).clamp(max=0.0)
        hi = blk.amax(dim=0).clamp(min=0.0)
        s = ((hi - lo) / levels).half().float()
        s_div = torch.where(s == 0, torch.ones_like(s), s)
        z = torch.clamp(torch.round(-lo / s_div), 0, levels)
        q = torch.clamp(torch.round(blk / s_div) + z, 0, levels)
        k_hat[start:start + blk.shape[0]] = s * (q - z)
    return k_hat
'''

_WRITTEN = {"kivi_keys": [("K3: the straddling chunk's range from its old tokens only",
                           OLD_TOKENS_ONLY)]}

_EDITS = {
    "kivi_keys": [
        ("K1: one scale per token (over its channels)",
         [(BLOCKS, "k[:end].reshape(end, k.shape[1], 1)")]),
        ("K2: token t in chunk t % n (the reshape's order swapped)",
         [(BLOCKS, "k[:end].reshape(chunk, end // chunk, k.shape[1]).transpose(0, 1)")]),
        ("K3: the partial chunk before the window left in float (floor, not ceil)",
         [(END, "end = old // chunk * chunk")]),
        ("K4: the window at the start of the cache",
         [(WIN, "k_hat[end:] = k[end:]\n    k_hat[:window] = k[:window]")]),
        ("K4: the window one token short", [(WIN, "k_hat[old + 1:] = k[old + 1:]")]),
        ("K5: S - window not clamped at 0", [(OLD, "old = k.shape[0] - window")]),
        ("K6: the range does not include 0",
         [(LO, "lo = blocks.amin(dim=1)"), (HI, "hi = blocks.amax(dim=1)")]),
        ("K7: codes from the unrounded float32 scale",
         [(S, "s32 = (hi - lo) / levels\n    s = s32.half().float()"),
          (S_DIV, "s_div = torch.where(s32 == 0, torch.ones_like(s32), s32)")]),
        ("K7: the scale never rounded to float16", [(S, "s = (hi - lo) / levels")]),
        ("K8: z rounded half up", [(Z, "torch.floor(-lo / s_div + 0.5)")]),
        ("K9: z added before rounding",
         [(X_S, "torch.round(blocks / s_div[:, None] + z[:, None])")]),
        ("K9: floor instead of round",
         [(X_S, "torch.floor(blocks / s_div[:, None]) + z[:, None]")]),
        ("K9: round half up", [(X_S, "torch.floor(blocks / s_div[:, None] + 0.5) + z[:, None]")]),
        ("K10: codes not clamped", [(Q, f"q = {X_S}")]),
        ("K11: multiply by the reciprocal 1 / s",
         [(X_S, "torch.round(blocks * (1 / s_div[:, None])) + z[:, None]")]),
        ("K12: s * (q - z) in float16",
         [(DQ, "(s[:, None].half() * (q - z[:, None]).half()).float()")]),
        ("K13: no guard for an all-zero chunk (0 / 0)", [(S_DIV, "s_div = s")]),
    ],
    "fp8_kv_cache": [
        ("P1: the scale from x (dynamic), not from calib",
         [(AMAX_HEAD, AMAX_HEAD.replace("calib", "x")),
          (AMAX_ALL, AMAX_ALL.replace("calib", "x"))]),
        ("P2: per head, the global amax for every head",
         [(AMAX_HEAD, "amax = calib.abs().amax().expand(calib.shape[0], 1, 1)")]),
        ("P2: per head, the amax of each head's first token only",
         [(AMAX_HEAD, "amax = calib[:, 0].abs().amax(dim=1)[:, None, None]")]),
        ("P3: scale = amax * (1 / 448)",
         [(SCALE, SCALE.replace("amax / 448", "amax * (1 / 448)"))]),
        ("P4: no guard: an all-zero head gets scale 0", [(SCALE, "scale = amax / 448")]),
        ("P5: x * (1 / scale)", [(Y, "y = (x * (1 / scale)).clamp(-448, 448)")]),
        ("P5: x * 448 / amax", [(Y, "y = (x * 448 / amax).clamp(-448, 448)")]),
        ("P5: x / amax * 448", [(Y, "y = (x / amax * 448).clamp(-448, 448)")]),
        ("P6: ties away from zero (y nudged one ulp outward)",
         [(Y, Y + "\n    y = torch.nextafter(y, 2 * y)")]),
        ("P7: NaN beyond 448 instead of saturating",
         [(Y, "y = x / scale\n    y = torch.where(y.abs() > 448, torch.nan, y)")]),
        ("P8: read back in float16", [(READ, "(e4m3.half() * scale.half()).float()")]),
    ],
    "kv_budget": [
        ("B1: keys only (no x 2 for the values)", [(PER_TOKEN, PER_TOKEN.replace(" * 2", ""))]),
        ("B2: the query heads (n_heads) cached", [(PER_TOKEN, PER_TOKEN.replace("n_kv", "n"))]),
        ("B3: scales and zero points not counted", [(QUANT, "quantized = bits")]),
        ("B3: KIVI's fp16 minimum instead of the zero point",
         [(QUANT, "quantized = bits + (16 + 16) / 32")]),
        ("B3: the zero point not counted", [(QUANT, "quantized = bits + 16 / 32")]),
        ("B4: the window ignored", [(N_FLOAT, "n_float = 0")]),
        ("B4: the whole window counted when context < window", [(N_FLOAT, "n_float = window")]),
        ("B5: bits per token, not bytes", [(PER_TOKEN, PER_TOKEN.removesuffix(" / 8"))]),
        ("B6: the weights ignored", [(FREE, "free = memory_bytes")]),
        ("B6: the weights at 16 bits", [(FREE, "free = memory_bytes - n_params * 2")]),
        ("B7: round, not floor", [(SEQS, SEQS.replace("math.floor", "round"))]),
        ("B7: negative when the weights do not fit",
         [(SEQS, "sequences = math.floor(free / (bytes_per_token * context))")]),
    ],
}

MUTANTS = build_mutants(_EDITS, _WRITTEN)
