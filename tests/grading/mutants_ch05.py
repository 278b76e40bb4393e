"""Known-wrong implementations for chapter 05 (microscaling): one per spec clause of
qlab/grading/tasks/ch05_mx.py (its id starts the name), plus classic mistakes. _WRITTEN:
whole cells; _EDITS: textual edits of the solution cell. See grading_bank.py."""

from __future__ import annotations

from mutant_edits import build_mutants

MX_CLAMP = "torch.clamp(exponent - EMAX[element], -127, 127)"
FP4_EXP = "exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127"
NV_TS = "ts = x.abs().max() / (6.0 * 448.0)"
NV_HP = "(blocks.abs().amax(dim=-1) / 6.0) / ts"
NV_CODES = "codes = FP4.encode(blocks / (ts * bs)[..., None])"
# a hand-written E2M1 encoder whose ties go UP (the false pass), and E4M3 rounding
# of the block scale with ties up
E2M1_UP = """
POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
def e2m1_up(y):
    idx = torch.bucketize(y.abs().clamp(max=6.0), (POS[1:] + POS[:-1]) / 2, right=True)
    return (idx | (torch.signbit(y).to(torch.int64) << 3)).to(torch.uint8)
"""
E2M1_NO_SAT = """
POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0])  # 8: the next step up
def e2m1_no_sat(y):
    idx = torch.bucketize(y.abs(), (POS[1:] + POS[:-1]) / 2)
    return (idx | (torch.signbit(y).to(torch.int64) << 3)).to(torch.uint8)
"""
E4M3_UP = (
    "pos = FP8.values[FP8.values >= 0]\n"
    "    bs = pos[torch.bucketize(bs_hp, (pos[1:] + pos[:-1]) / 2, right=True)]"
)

_WRITTEN: dict[str, list[tuple[str, str]]] = {
    "mx_scale": [
        (
            "X2 exponent from torch.log2 (off by one below powers of two)",
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
            "X1 blocks of 16",
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
            "M1 scale amax / 6 (not a power of two)",
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
            "M1 emax of E4M3 used for FP4",
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
            "V4 no 2^-6 floor on the block scale",
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
            "V7 blocks of 32",
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
            "V1 tensor scale amax / 6 (no 448)",
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
}

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "mx_scale": [
        (
            "X4 exponent not clamped (zero and tiny blocks)",
            [(MX_CLAMP, "exponent - EMAX[element]")],
        ),
        ("X3 emax 4 for E2M3 (E3M2's)", [('"fp6_e2m3fn": 2', '"fp6_e2m3fn": 4')]),
        ("X3 emax 16 for E5M2", [('"fp8_e5m2": 15', '"fp8_e5m2": 16')]),
        (
            "X5 an all-zero block gets scale 0",
            [
                (
                    "return torch.ldexp(torch.ones_like(amax), shared)",
                    "return torch.ldexp(torch.ones_like(amax), shared) * (amax != 0)",
                )
            ],
        ),
        (
            "X6 scales returned as float64",
            [("return torch.ldexp(torch.ones_like(amax), shared)",
              "return torch.ldexp(torch.ones_like(amax), shared).double()")],
        ),
    ],
    "mxfp4_quantize": [
        (
            "M1 exponent from floor(torch.log2(amax))",
            [(FP4_EXP, "exponent = torch.floor(torch.log2(amax)).int()")],
        ),
        ("M1 exponent not clamped", [("torch.clamp(exponent - 2, -127, 127)", "exponent - 2")]),
        (
            "M3 no saturation: 7.5 X rounds to 8, code 8 (which is -0)",
            [
                (
                    'FP4 = qlab.formats.get("fp4_e2m1fn")',
                    'FP4 = qlab.formats.get("fp4_e2m1fn")\n' + E2M1_NO_SAT,
                ),
                ("FP4.encode(blocks)", "e2m1_no_sat(blocks)"),
            ],
        ),
        (
            "M4 +0 (code 0) for a negative element that rounds to zero",
            [("return FP4.encode(blocks).reshape(rows, k), scales",
              "codes = FP4.encode(blocks)\n"
              "    codes = torch.where(codes == 8, torch.zeros_like(codes), codes)\n"
              "    return codes.reshape(rows, k), scales")],
        ),
        (
            "M2 E2M1 ties go up",
            [
                (
                    'FP4 = qlab.formats.get("fp4_e2m1fn")',
                    'FP4 = qlab.formats.get("fp4_e2m1fn")\n' + E2M1_UP,
                ),
                ("FP4.encode(blocks)", "e2m1_up(blocks)"),
            ],
        ),
        (
            "M5 codes returned as int64",
            [("return FP4.encode(blocks).reshape(rows, k), scales",
              "return FP4.encode(blocks).reshape(rows, k).long(), scales")],
        ),
    ],
    "nvfp4_quantize": [
        ("V1 ts = (amax / 6) / 448", [(NV_TS, "ts = x.abs().max() / 6.0 / 448.0")]),
        ("V1 ts = amax * (1 / 2688)", [(NV_TS, "ts = x.abs().max() * (1 / (6.0 * 448.0))")]),
        ("V2 bs_hp = block_amax / (6 ts)", [(NV_HP, "blocks.abs().amax(dim=-1) / (6.0 * ts)")]),
        ("V2 bs_hp = (block_amax / ts) / 6", [(NV_HP, "(blocks.abs().amax(dim=-1) / ts) / 6.0")]),
        (
            "V5 x / ts / bs instead of x / (ts * bs)",
            [(NV_CODES, "codes = FP4.encode(blocks / ts / bs[..., None])")],
        ),
        ("V3 E4M3 block scale ties go up", [("bs = FP8.decode(FP8.encode(bs_hp))", E4M3_UP)]),
        (
            "V8 +0 (code 0) for a negative element that rounds to zero",
            [(NV_CODES,
              NV_CODES + "\n    codes = torch.where(codes == 8, torch.zeros_like(codes), codes)")],
        ),
        (
            "V4 floor only for all-zero blocks (tiny blocks go subnormal)",
            [
                (
                    f"torch.clamp({NV_HP}, 2.0**-6, 448.0)",
                    f"torch.where({NV_HP} == 0, 2.0**-6, torch.clamp({NV_HP}, max=448.0))",
                )
            ],
        ),
        (
            "V6 E2M1 ties go up",
            [
                (
                    'FP8 = qlab.formats.get("fp8_e4m3fn")',
                    'FP8 = qlab.formats.get("fp8_e4m3fn")\n' + E2M1_UP,
                ),
                (
                    "FP4.encode(blocks / (ts * bs)[..., None])",
                    "e2m1_up(blocks / (ts * bs)[..., None])",
                ),
            ],
        ),
        (
            "V9 tensor scale returned as float64",
            [("return codes.reshape(rows, k), bs, ts",
              "return codes.reshape(rows, k), bs, ts.double()")],
        ),
    ],
}

MUTANTS = build_mutants(_EDITS, _WRITTEN)
