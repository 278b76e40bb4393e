"""Known-wrong implementations for chapter 04 (FP8): one per spec clause of
qlab/grading/tasks/ch04_fp8.py (its id starts the name), plus classic mistakes. _WRITTEN:
whole cells; _EDITS: textual edits of the solution cell. See grading_bank.py."""

from __future__ import annotations

from mutant_edits import build_mutants

TIE = "((hi - mag == mag - lo) & (i % 2 == 0))"
SIGN_LINE = "code = code | (torch.signbit(x).to(torch.int64) << 7)"

_WRITTEN: dict[str, list[tuple[str, str]]] = {
    "e4m3_decode": [
        (
            "F3 0x7F decoded as 480 (no NaN)",
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
            "F2 subnormals decoded as normals",
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
            "F4 -0.0 loses its sign",
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
}

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "e4m3_decode": [
        ("F3 only 0x7F is NaN (0xFF decodes to -480)", [("(c & 0x7F) == 0x7F", "c == 0x7F")]),
        ("F1 exponent bias 8", [("torch.exp2(e.float() - 7)", "torch.exp2(e.float() - 8)")]),
        (
            "F5 values returned as float64",
            [('torch.tensor(float("nan")), v)', 'torch.tensor(float("nan")), v).double()')],
        ),
    ],
    "e4m3_encode": [
        (
            "C4 NaN instead of saturation",
            [(SIGN_LINE, "code = torch.where(x.abs() > 464.0, 0x7F, code)\n    " + SIGN_LINE)],
        ),
        (
            "C2 round half away from zero",
            [(f"(hi - mag < mag - lo) | {TIE}", "hi - mag <= mag - lo")],
        ),
        ("C5 sign from x < 0: -0.0 becomes 0x00", [("torch.signbit(x)", "(x < 0)")]),
        ("C6 codes returned as int64", [("return code.to(torch.uint8)", "return code")]),
        ("C2 ties toward zero", [(TIE, "((hi - mag == mag - lo) & (i < 0))")]),
        ("C1 rounds up to the next value", [("(hi - mag < mag - lo)", "(mag > lo)")]),
        ("C3 subnormal ties go up", [(TIE, "((hi - mag == mag - lo) & ((i % 2 == 0) | (i < 8)))")]),
    ],
}

MUTANTS = build_mutants(_EDITS, _WRITTEN)
