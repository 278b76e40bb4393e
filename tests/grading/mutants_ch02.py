"""Known-wrong implementations for chapter 02 (granularity): one per spec clause of
qlab/grading/tasks/ch02_granularity.py (its id starts the name), plus classic mistakes. _WRITTEN:
whole cells; _EDITS: textual edits of the solution cell. See grading_bank.py."""

from __future__ import annotations

from mutant_edits import build_mutants

ROUND = "torch.round(blocks / s[..., None])"

_WRITTEN: dict[str, list[tuple[str, str]]] = {
    "group_quantize": [
        (
            "G1 per-tensor instead of per-group",
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
            "G1 groups strided across the row",
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
            "G1 per-channel (one scale per row)",
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
            "B2 forgets the zero point",
            """
def bits_per_weight(bits, group_size, scale_bits, zero_bits):
    return bits + scale_bits / group_size
""",
        ),
        (
            "B1 metadata not amortised",
            """
def bits_per_weight(bits, group_size, scale_bits, zero_bits):
    return float(bits + scale_bits + zero_bits)
""",
        ),
    ],
}

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "group_quantize": [
        ("G5 round half up", [(ROUND, "torch.floor(blocks / s[..., None] + 0.5)")]),
        (
            "G7 codes returned as int64",
            [(", -qmax, qmax).to(torch.int8)", ", -qmax, qmax).long()")],
        ),
        (
            "G3 codes from the unrounded float32 scales",
            [("    s = scales.float()\n", "    s = blocks.abs().amax(dim=-1) / qmax\n")],
        ),
        ("G4 multiply by the reciprocal", [(ROUND, "torch.round(blocks * (1 / s[..., None]))")]),
        (
            "G2 scales stored as bfloat16",
            [("/ qmax).to(torch.float16)", "/ qmax).to(torch.bfloat16)")],
        ),
        (
            "G6 absmax rounded to float16 before the division",
            [("blocks.abs().amax(dim=-1) / qmax)",
              "blocks.abs().amax(dim=-1).half().float() / qmax)")],
        ),
        (
            "G8 codes not clamped (a subnormal float16 scale passes qmax)",
            [(f"torch.clamp({ROUND}, -qmax, qmax)", ROUND)],
        ),
    ],
    "bits_per_weight": [
        (
            "B3 integer division",
            [("(scale_bits + zero_bits) / group_size", "(scale_bits + zero_bits) // group_size")],
        ),
    ],
}

MUTANTS = build_mutants(_EDITS, _WRITTEN)
