"""Known-wrong implementations and submission builders for the grader's tests.

MUTANTS[grade_id] = [(name, cell source), ...]: each replaces that task's solution cell
and must cost exactly that task's points. Submissions are built from solutions/ by
swapping cell sources, so they track the solution notebooks automatically.

Other chapters add their own bank in ``tests/grading/mutants_<chapter>.py`` (a module
with a ``MUTANTS`` dict of the same form); it is merged in below.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"

SYM_HEAD = "def symmetric_quantize(x, bits):\n    qmax = 2 ** (bits - 1) - 1\n"
ASYM_HEAD = "def asymmetric_quantize(x, bits):\n    qmax = 2 ** bits - 1\n"

MUTANTS: dict[str, list[tuple[str, str]]] = {
    "sym_quantize": [
        (
            "round half away from zero",
            SYM_HEAD
            + """
    scale = (x.abs().max() / qmax).to(torch.float16)
    s = scale.float() if scale != 0 else torch.tensor(1.0)
    y = x / s
    codes = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return torch.clamp(codes, -qmax, qmax).to(torch.int8), scale
""",
        ),
        (
            "grid -8..7 (divides by 2^(b-1))",
            SYM_HEAD
            + """
    scale = (x.abs().max() / (qmax + 1)).to(torch.float16)
    s = scale.float() if scale != 0 else torch.tensor(1.0)
    return torch.clamp(torch.round(x / s), -qmax - 1, qmax).to(torch.int8), scale
""",
        ),
        (
            "scale kept in float32",
            SYM_HEAD
            + """
    scale = x.abs().max() / qmax
    s = scale if scale != 0 else torch.tensor(1.0)
    return torch.clamp(torch.round(x / s), -qmax, qmax).to(torch.int8), scale
""",
        ),
    ],
    "asym_quantize": [
        (
            "off-by-one zero point",
            ASYM_HEAD
            + """
    lo = torch.clamp(x.min(), max=0.0)
    hi = torch.clamp(x.max(), min=0.0)
    scale = ((hi - lo) / qmax).to(torch.float16)
    s = scale.float() if scale != 0 else torch.tensor(1.0)
    z = torch.clamp(torch.round(-lo / s) + 1, 0, qmax)
    codes = torch.clamp(torch.round(x / s) + z, 0, qmax).to(torch.uint8)
    return codes, scale, z.to(torch.uint8)
""",
        ),
        (
            "range without 0",
            ASYM_HEAD
            + """
    lo, hi = x.min(), x.max()
    scale = ((hi - lo) / qmax).to(torch.float16)
    s = scale.float() if scale != 0 else torch.tensor(1.0)
    z = torch.clamp(torch.round(-lo / s), 0, qmax)
    codes = torch.clamp(torch.round(x / s) + z, 0, qmax).to(torch.uint8)
    return codes, scale, z.to(torch.uint8)
""",
        ),
        (
            "2^b levels instead of 2^b - 1 steps",
            ASYM_HEAD
            + """
    lo = torch.clamp(x.min(), max=0.0)
    hi = torch.clamp(x.max(), min=0.0)
    scale = ((hi - lo) / (qmax + 1)).to(torch.float16)
    s = scale.float() if scale != 0 else torch.tensor(1.0)
    z = torch.clamp(torch.round(-lo / s), 0, qmax)
    codes = torch.clamp(torch.round(x / s) + z, 0, qmax).to(torch.uint8)
    return codes, scale, z.to(torch.uint8)
""",
        ),
    ],
    "affine_dequantize": [
        (
            "uint8 wrap-around",
            """
def affine_dequantize(codes, scale, zero_point):
    return scale.float() * (codes - zero_point).float()
""",
        ),
        (
            "s * q - z",
            """
def affine_dequantize(codes, scale, zero_point):
    return scale.float() * codes.float() - zero_point.float()
""",
        ),
    ],
    "group_quantize": [
        (
            "per-tensor instead of per-group",
            """
def group_quantize(w, bits, group_size):
    qmax = 2 ** (bits - 1) - 1
    rows, k = w.shape
    s = (w.abs().max() / qmax).to(torch.float16)
    codes = torch.clamp(torch.round(w / s.float()), -qmax, qmax).to(torch.int8)
    return codes, s.expand(rows, k // group_size).clone()
""",
        ),
        (
            "groups strided across the row",
            """
def group_quantize(w, bits, group_size):
    qmax = 2 ** (bits - 1) - 1
    rows, k = w.shape
    blocks = w.reshape(rows, group_size, k // group_size).transpose(1, 2)
    scales = (blocks.abs().amax(dim=-1) / qmax).to(torch.float16)
    s = torch.where(scales == 0, 1.0, scales.float())
    codes = torch.clamp(torch.round(blocks / s[..., None]), -qmax, qmax).to(torch.int8)
    return codes.transpose(1, 2).reshape(rows, k), scales
""",
        ),
        (
            "per-channel (one scale per row)",
            """
def group_quantize(w, bits, group_size):
    qmax = 2 ** (bits - 1) - 1
    rows, k = w.shape
    scales = (w.abs().amax(dim=1, keepdim=True) / qmax).to(torch.float16)
    s = torch.where(scales == 0, 1.0, scales.float())
    codes = torch.clamp(torch.round(w / s), -qmax, qmax).to(torch.int8)
    return codes, scales.expand(rows, k // group_size).clone()
""",
        ),
    ],
    "bits_per_weight": [
        (
            "forgets the zero point",
            """
def bits_per_weight(bits, group_size, scale_bits, zero_bits):
    return bits + scale_bits / group_size
""",
        ),
        (
            "metadata not amortised",
            """
def bits_per_weight(bits, group_size, scale_bits, zero_bits):
    return float(bits + scale_bits + zero_bits)
""",
        ),
    ],
    "nf4_levels": [
        (
            "8 and 8 quantiles, symmetric",
            """
def nf4_levels(offset):
    ndtri = torch.special.ndtri
    pos = ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    levels = torch.cat([-pos, pos]).sort().values
    return (levels / levels.max()).to(torch.float32)
""",
        ),
        (
            "offset fixed at QLoRA's value (a pasted table)",
            """
def nf4_levels(offset):
    return qlab.formats.NF4_LEVELS.clone()
""",
        ),
    ],
    "nf4_quantize": [
        (
            "blocks of 32",
            """
def nf4_quantize(w):
    rows, k = w.shape
    blocks = w.reshape(rows, k // 32, 32)
    absmax = blocks.abs().amax(dim=-1)
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), 1.0 / absmax)
    mids = ((NF4_VALUES[:-1].double() + NF4_VALUES[1:].double()) / 2).float()
    codes = torch.bucketize(blocks * inv[..., None], mids).to(torch.uint8)
    return codes.reshape(rows, k), absmax[:, ::2]
""",
        ),
        (
            "midpoint ties take the upper code",
            """
def nf4_quantize(w):
    rows, k = w.shape
    blocks = w.reshape(rows, k // 64, 64)
    absmax = blocks.abs().amax(dim=-1)
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), 1.0 / absmax)
    mids = ((NF4_VALUES[:-1].double() + NF4_VALUES[1:].double()) / 2).float()
    codes = torch.bucketize(blocks * inv[..., None], mids, right=True).to(torch.uint8)
    return codes.reshape(rows, k), absmax
""",
        ),
    ],
    "e4m3_decode": [
        (
            "0x7F decoded as 480 (no NaN)",
            """
def decode_e4m3(codes):
    c = codes.to(torch.int32)
    sign = torch.where((c >> 7) & 1 == 1, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, (c & 0x7).float()
    v = torch.where(e == 0, 2.0**-6 * (m / 8), torch.exp2(e.float() - 7) * (1 + m / 8))
    return sign * v
""",
        ),
        (
            "subnormals decoded as normals",
            """
def decode_e4m3(codes):
    c = codes.to(torch.int32)
    sign = torch.where((c >> 7) & 1 == 1, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, (c & 0x7).float()
    v = sign * torch.exp2(e.float() - 7) * (1 + m / 8)
    return torch.where((c & 0x7F) == 0x7F, torch.tensor(float("nan")), v)
""",
        ),
        (
            "-0.0 loses its sign",
            """
def decode_e4m3(codes):
    c = codes.to(torch.int32)
    sign = torch.where((c >> 7) & 1 == 1, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, (c & 0x7).float()
    v = sign * torch.where(e == 0, 2.0**-6 * (m / 8), torch.exp2(e.float() - 7) * (1 + m / 8))
    v = torch.where(v == 0, torch.zeros_like(v), v)
    return torch.where((c & 0x7F) == 0x7F, torch.tensor(float("nan")), v)
""",
        ),
    ],
    "e4m3_encode": [
        (
            "NaN instead of saturation",
            """
E4M3_VALUES = qlab.formats.get("fp8_e4m3fn").values
def encode_e4m3(x):
    table = E4M3_VALUES[E4M3_VALUES >= 0]
    mag = x.abs().clamp(max=448.0)
    i = torch.bucketize(mag, table).clamp(1, 126)
    lo, hi = table[i - 1], table[i]
    take_hi = (hi - mag < mag - lo) | ((hi - mag == mag - lo) & (i % 2 == 0))
    code = torch.where(take_hi, i, i - 1)
    code = torch.where(mag == 0, torch.zeros_like(code), code)
    code = torch.where(x.abs() > 464.0, torch.full_like(code, 0x7F), code)
    code = code | (torch.signbit(x).to(torch.int64) << 7)
    return code.to(torch.uint8)
""",
        ),
        (
            "round half away from zero",
            """
E4M3_VALUES = qlab.formats.get("fp8_e4m3fn").values
def encode_e4m3(x):
    table = E4M3_VALUES[E4M3_VALUES >= 0]
    mag = x.abs().clamp(max=448.0)
    i = torch.bucketize(mag, table).clamp(1, 126)
    lo, hi = table[i - 1], table[i]
    code = torch.where(hi - mag <= mag - lo, i, i - 1)
    code = torch.where(mag == 0, torch.zeros_like(code), code)
    code = code | (torch.signbit(x).to(torch.int64) << 7)
    return code.to(torch.uint8)
""",
        ),
    ],
    "mx_scale": [
        (
            "exponent from torch.log2 (off by one below powers of two)",
            """
EMAX = {"fp4_e2m1fn": 2, "fp6_e2m3fn": 2, "fp6_e3m2fn": 4, "fp8_e4m3fn": 8, "fp8_e5m2": 15}
def mx_block_scales(x, element):
    rows, k = x.shape
    amax = x.reshape(rows, k // 32, 32).abs().amax(dim=-1)
    e = torch.floor(torch.log2(amax)).clamp(-127 + EMAX[element], 127 + EMAX[element])
    return torch.exp2(torch.clamp(e - EMAX[element], -127, 127))
""",
        ),
        (
            "blocks of 16",
            """
EMAX = {"fp4_e2m1fn": 2, "fp6_e2m3fn": 2, "fp6_e3m2fn": 4, "fp8_e4m3fn": 8, "fp8_e5m2": 15}
def mx_block_scales(x, element):
    rows, k = x.shape
    amax = x.reshape(rows, k // 16, 16).abs().amax(dim=-1)[:, ::2]
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    return torch.ldexp(torch.ones_like(amax), torch.clamp(exponent - EMAX[element], -127, 127))
""",
        ),
    ],
    "mxfp4_quantize": [
        (
            "scale amax / 6 (not a power of two)",
            """
FP4 = qlab.formats.get("fp4_e2m1fn")
def mxfp4_quantize(x):
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    scales = blocks.abs().amax(dim=-1) / 6.0
    s = torch.where(scales == 0, 1.0, scales)
    return FP4.encode(blocks / s[..., None]).reshape(rows, k), scales
""",
        ),
        (
            "emax of E4M3 used for FP4",
            """
FP4 = qlab.formats.get("fp4_e2m1fn")
def mxfp4_quantize(x):
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    scales = torch.ldexp(torch.ones_like(amax), torch.clamp(exponent - 8, -127, 127))
    return FP4.encode(blocks / scales[..., None]).reshape(rows, k), scales
""",
        ),
    ],
    "nvfp4_quantize": [
        (
            "no 2^-6 floor on the block scale",
            """
FP8 = qlab.formats.get("fp8_e4m3fn")
def nvfp4_quantize(x):
    rows, k = x.shape
    ts = x.abs().max() / (6.0 * 448.0)
    blocks = x.reshape(rows, k // 16, 16)
    bs = FP8.decode(FP8.encode(torch.clamp((blocks.abs().amax(dim=-1) / 6.0) / ts, max=448.0)))
    return FP4.encode(blocks / (ts * bs)[..., None]).reshape(rows, k), bs, ts
""",
        ),
        (
            "blocks of 32",
            """
FP8 = qlab.formats.get("fp8_e4m3fn")
def nvfp4_quantize(x):
    rows, k = x.shape
    ts = x.abs().max() / (6.0 * 448.0)
    b32 = x.reshape(rows, -1, 32) if k % 32 == 0 else x.reshape(rows, -1, 16)
    bs = FP8.decode(FP8.encode(torch.clamp((b32.abs().amax(dim=-1) / 6.0) / ts, 2.0**-6, 448.0)))
    bs = bs.repeat_interleave(b32.shape[-1] // 16, dim=-1)
    blocks = x.reshape(rows, k // 16, 16)
    return FP4.encode(blocks / (ts * bs)[..., None]).reshape(rows, k), bs, ts
""",
        ),
        (
            "tensor scale amax / 6 (no 448)",
            """
FP8 = qlab.formats.get("fp8_e4m3fn")
def nvfp4_quantize(x):
    rows, k = x.shape
    ts = x.abs().max() / 6.0
    blocks = x.reshape(rows, k // 16, 16)
    bs = FP8.decode(FP8.encode(torch.clamp((blocks.abs().amax(dim=-1) / 6.0) / ts, 2.0**-6, 448.0)))
    return FP4.encode(blocks / (ts * bs)[..., None]).reshape(rows, k), bs, ts
""",
        ),
    ],
    "pack_int4": [
        (
            "wrong nibble order",
            """
def pack_int4(codes):
    n = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    return n[..., 1::2] | (n[..., 0::2] << 4)
""",
        ),
        (
            "pairs along the wrong axis",
            """
def pack_int4(codes):
    n = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    half = codes.shape[-1] // 2
    return n[..., :half] | (n[..., half:] << 4)
""",
        ),
    ],
    "unpack_int4": [
        (
            "wrong nibble order",
            """
def unpack_int4(packed, signed):
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    codes = torch.stack([hi, lo], dim=-1).reshape(*packed.shape[:-1], -1)
    return torch.where(codes >= 8, codes - 16, codes) if signed else codes
""",
        ),
        (
            "no sign extension",
            """
def unpack_int4(packed, signed):
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], -1)
""",
        ),
    ],
    "w8a8_matmul": [
        (
            "per-tensor activation scale",
            """
def w8a8_matmul(x, w):
    s_x = (x.abs().max() / 127).to(torch.float16).float()
    s_w = (w.abs().amax(dim=1) / 127).to(torch.float16).float()
    q_x = torch.clamp(torch.round(x / s_x), -127, 127)
    q_w = torch.clamp(torch.round(w / s_w[:, None]), -127, 127)
    return (q_x.double() @ q_w.double().T).float() * (s_x * s_w[None, :])
""",
        ),
        (
            "dequantize first, no fp16 scales",
            """
def w8a8_matmul(x, w):
    s_x = x.abs().amax(dim=1) / 127
    s_w = w.abs().amax(dim=1) / 127
    x_hat = torch.clamp(torch.round(x / s_x[:, None]), -127, 127) * s_x[:, None]
    w_hat = torch.clamp(torch.round(w / s_w[:, None]), -127, 127) * s_w[:, None]
    return x_hat @ w_hat.T
""",
        ),
    ],
}


CORE_ASSIGNMENTS = (
    "01_affine", "02_granularity", "03_nf4", "04_fp8", "05_mx", "06_wxay", "07_quality",
)


def _merge_chapter_banks() -> None:
    for path in sorted(Path(__file__).parent.glob("mutants_*.py")):
        module = importlib.import_module(path.stem)
        for gid, items in module.MUTANTS.items():
            MUTANTS.setdefault(gid, []).extend(items)


_merge_chapter_banks()


def load(name: str, folder: Path = SOLUTIONS) -> nbformat.NotebookNode:
    return nbformat.read(str(folder / f"{name}.ipynb"), as_version=4)


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def with_cells(
    nb, replace: dict[str, str] | None = None, after: dict[str, list[str]] | None = None
) -> nbformat.NotebookNode:
    """Copy of nb: cell sources replaced by grade_id; new plain cells inserted after one."""
    nb = copy.deepcopy(nb)
    replace, after = dict(replace or {}), dict(after or {})
    cells = []
    for cell in nb.cells:
        gid = grade_id(cell)
        if gid in replace:
            cell.source = replace.pop(gid).strip("\n")
        cells.append(cell)
        for src in after.pop(gid, []):
            cells.append(nbformat.v4.new_code_cell(src.strip("\n")))
    assert not replace and not after, f"unknown grade_ids: {list(replace) + list(after)}"
    nb.cells = cells
    return nb


def mutant_notebooks(
    names: tuple[str, ...] = CORE_ASSIGNMENTS,
) -> dict[str, tuple[str, nbformat.NotebookNode, set[str]]]:
    """name -> (assignment, notebook, grade_ids that must score 0). The i-th notebook of an
    assignment carries the i-th mutant of each of its tasks (so few kernels are needed)."""
    from qlab.grading import assignments

    out = {}
    for assignment in names:
        gids = assignments()[assignment]
        nb = load(assignment)
        depth = max(len(MUTANTS.get(g, [])) for g in gids)
        for i in range(depth):
            swap = {f"{g}_solution": MUTANTS[g][i][1] for g in gids if i < len(MUTANTS.get(g, []))}
            wrong = {g for g in gids if i < len(MUTANTS.get(g, []))}
            out[f"mutant{i}_{assignment}"] = (assignment, with_cells(nb, swap), wrong)
    return out
