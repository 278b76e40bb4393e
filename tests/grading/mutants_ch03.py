"""Known-wrong implementations for chapter 03 (NF4): one per spec clause of
qlab/grading/tasks/ch03_nf4.py (its id starts the name), plus classic mistakes. _WRITTEN:
whole cells; _EDITS: textual edits of the solution cell. See grading_bank.py."""

from __future__ import annotations

from mutant_edits import build_mutants

INV = "inv = torch.where(absmax == 0, torch.zeros_like(absmax), 1.0 / absmax)"
CODES = "codes = torch.bucketize(blocks * inv[..., None], mids, right=False).to(torch.uint8)"

_WRITTEN: dict[str, list[tuple[str, str]]] = {
    "nf4_levels": [
        (
            "L1 8 and 8 quantiles, symmetric",
            """
def nf4_levels(offset):
    ndtri = torch.special.ndtri
    pos = ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    levels = torch.cat([-pos, pos]).sort().values
    return (levels / levels.max()).to(torch.float32)
""",
        ),
        (
            "L4 offset fixed at QLoRA's value (a pasted table)",
            """
def nf4_levels(offset):
    return qlab.formats.NF4_LEVELS.clone()
""",
        ),
    ],
}

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "nf4_levels": [
        (
            "L2 not normalised by the largest level",
            [
                (
                    "return (levels / levels.max()).to(torch.float32)",
                    "return levels.to(torch.float32)",
                )
            ],
        ),
        ("L3 descending", [(".sort().values", ".sort(descending=True).values")]),
        (
            "L5 returned as float64",
            [("(levels / levels.max()).to(torch.float32)", "levels / levels.max()")],
        ),
    ],
    "nf4_quantize": [
        (
            "N1 blocks of 32",
            [
                ("w.reshape(rows, k // 64, 64)", "w.reshape(rows, k // 32, 32)"),
                (
                    "return codes.reshape(rows, k), absmax",
                    "return codes.reshape(rows, k), absmax[:, ::2]",
                ),
            ],
        ),
        ("N4 midpoint ties take the upper code", [("right=False", "right=True")]),
        (
            "N6 codes returned as int64 (bucketize's dtype)",
            [(CODES, CODES.replace(".to(torch.uint8)", ""))],
        ),
        (
            "N3 divide by absmax instead of multiplying by fp32(1 / absmax)",
            [
                (
                    CODES,
                    CODES.replace(
                        "blocks * inv[..., None]",
                        "blocks / torch.where(absmax == 0, 1.0, absmax)[..., None]",
                    ),
                )
            ],
        ),
        ("N5 all-zero block: reciprocal inf (0 * inf = NaN)", [(INV, "inv = 1.0 / absmax")]),
        (
            "N2 absmax stored as float16",
            [
                (
                    "return codes.reshape(rows, k), absmax",
                    "return codes.reshape(rows, k), absmax.half()",
                )
            ],
        ),
    ],
}

MUTANTS = build_mutants(_EDITS, _WRITTEN)
