"""Known-wrong implementations for chapter 01 (affine quantization): one per spec clause of
qlab/grading/tasks/ch01_affine.py (its id starts the name), plus classic mistakes. _WRITTEN:
whole cells; _EDITS: textual edits of the solution cell. See grading_bank.py."""

from __future__ import annotations

from mutant_edits import build_mutants

SYM_HEAD = "def symmetric_quantize(x, bits):\n    qmax = 2 ** (bits - 1) - 1\n"
ASYM_HEAD = "def asymmetric_quantize(x, bits):\n    qmax = 2 ** bits - 1\n"
SYM_S = "s = scale.float() if scale != 0 else torch.tensor(1.0)"
SYM_ROUND = "torch.round(x / s)"
Z = "zero_point = torch.clamp(torch.round(-lo / s), 0, qmax)"
CODES = "codes = torch.clamp(torch.round(x / s) + zero_point, 0, qmax).to(torch.uint8)"
ASYM_LO = "lo = torch.clamp(x.min(), max=0.0)"
ASYM_HI = "hi = torch.clamp(x.max(), min=0.0)"
ASYM_SCALE = "scale = ((hi - lo) / qmax).to(torch.float16)"
ASYM_RETURN = "return codes, scale, zero_point.to(torch.uint8)"
DEQ = "return scale.float() * (codes.float() - zero_point.float())"

_WRITTEN: dict[str, list[tuple[str, str]]] = {
    "sym_quantize": [
        (
            "S5 round half away from zero",
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
            "S1 grid -8..7 (divides by 2^(b-1))",
            SYM_HEAD
            + """
    scale = (x.abs().max() / (qmax + 1)).to(torch.float16)
    s = scale.float() if scale != 0 else torch.tensor(1.0)
    return torch.clamp(torch.round(x / s), -qmax - 1, qmax).to(torch.int8), scale
""",
        ),
        (
            "S2 scale kept in float32",
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
            "A1 range without 0",
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
            "A2 2^b levels instead of 2^b - 1 steps",
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
            "D1 uint8 wrap-around",
            """
def affine_dequantize(codes, scale, zero_point):
    return scale.float() * (codes - zero_point).float()
""",
        ),
        (
            "D1 s * q - z",
            """
def affine_dequantize(codes, scale, zero_point):
    return scale.float() * codes.float() - zero_point.float()
""",
        ),
    ],
}

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "sym_quantize": [
        ("S5 round half up: floor(x / s + 0.5)", [(SYM_ROUND, "torch.floor(x / s + 0.5)")]),
        (
            "S3 codes from the unrounded float32 scale",
            [(SYM_S, SYM_S.replace("scale.float()", "x.abs().max() / qmax"))],
        ),
        ("S4 multiply by the reciprocal 1 / s", [(SYM_ROUND, "torch.round(x * (1 / s))")]),
        (
            "S6 absmax rounded to float16 before the division",
            [
                (
                    "(x.abs().max() / qmax).to(torch.float16)",
                    "(x.abs().max().half().float() / qmax).to(torch.float16)",
                )
            ],
        ),
        ("S7 codes returned as int64", [(".to(torch.int8)", ".to(torch.int64)")]),
        ("S7 scale returned as float32", [("return codes, scale", "return codes, scale.float()")]),
        (
            "S8 codes not clamped (a subnormal float16 scale passes qmax)",
            [(f"torch.clamp({SYM_ROUND}, -qmax, qmax)", SYM_ROUND)],
        ),
        (
            "S2 scale stored as bfloat16",
            [
                (
                    "(x.abs().max() / qmax).to(torch.float16)",
                    "(x.abs().max() / qmax).to(torch.bfloat16)",
                )
            ],
        ),
    ],
    "asym_quantize": [
        (
            "A3 zero point from the unrounded float32 scale",
            [(Z, Z.replace("-lo / s", "-lo / ((hi - lo) / qmax)"))],
        ),
        (
            "A7 codes from the unrounded float32 scale",
            [(CODES, CODES.replace("x / s", "x / ((hi - lo) / qmax)"))],
        ),
        ("A8 multiply by the reciprocal 1 / s", [(CODES, CODES.replace("x / s", "x * (1 / s)"))]),
        (
            "A4 zero point rounded half up",
            [(Z, Z.replace("torch.round(-lo / s)", "torch.floor(-lo / s + 0.5)"))],
        ),
        (
            "A5 round(x / s + z): z added before rounding",
            [
                (
                    CODES,
                    CODES.replace(
                        "torch.round(x / s) + zero_point", "torch.round(x / s + zero_point)"
                    ),
                )
            ],
        ),
        (
            "A6 codes not clamped (2^b wraps to 0)",
            [(CODES, "codes = (torch.round(x / s) + zero_point).to(torch.uint8)")],
        ),
        (
            "A9 hi - lo rounded to float16 before the division",
            [(ASYM_SCALE, "scale = ((hi - lo).half().float() / qmax).to(torch.float16)")],
        ),
        (
            "A9 lo and hi rounded to float16 first",
            [(ASYM_LO, ASYM_LO + ".half().float()"), (ASYM_HI, ASYM_HI + ".half().float()")],
        ),
        (
            "A9 scale in float16 arithmetic",
            [(ASYM_SCALE, "scale = (hi.half() - lo.half()) / qmax")],
        ),
        (
            "A10 scale returned as float32",
            [(ASYM_RETURN, ASYM_RETURN.replace("scale,", "scale.float(),"))],
        ),
        ("A10 zero point returned as float32", [(ASYM_RETURN, "return codes, scale, zero_point")]),
        (
            "A11 zero point not clamped (a subnormal float16 scale passes 2^b - 1)",
            [(Z, "zero_point = torch.round(-lo / s)")],
        ),
    ],
    "affine_dequantize": [
        (
            "D3 float64 output",
            [(DEQ, "return scale.double() * (codes.double() - zero_point.double())")],
        ),
        (
            "D2 product in float16",
            [(DEQ, "return (scale * (codes.float() - zero_point.float()).half()).float()")],
        ),
    ],
}

MUTANTS = build_mutants(_EDITS, _WRITTEN)
