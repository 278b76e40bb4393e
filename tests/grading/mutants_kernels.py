"""Known-wrong kernels for the Triton exercises (chapters 08-10), merged into
grading_bank.MUTANTS. Each is the solution cell with one textual change, so the bank
tracks the solutions (an edit whose text is gone fails loudly at import).

MUTANTS[grade_id] = [(name, cell source), ...]. tests/kernels/test_kernel_exercises.py
checks them in-process and grades a class of kernel submissions end to end.
"""

from __future__ import annotations

from mutant_edits import build_mutants

SIGN = ("code = tl.where(nibble >= 8, nibble - 16, nibble)", "code = nibble")


def _swap_nibbles(k: str) -> tuple[str, str]:
    """The odd element read from the low nibble: the classic packing bug."""
    return f"(({k} % 2) * 4)", f"((1 - {k} % 2) * 4)"


# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "triton_unpack_int4": [
        ("odd column from the low nibble", [_swap_nibbles("cols[None, :]")]),
        ("no sign extension", [SIGN]),
    ],
    "triton_dequant": [
        (
            "group index from the byte column",
            [("cols[None, :] // GROUP_SIZE", "(cols[None, :] // 2) // GROUP_SIZE")],
        ),
        ("no sign extension", [SIGN]),
        ("odd column from the low nibble", [_swap_nibbles("cols[None, :]")]),
    ],
    "w4a16_gemv": [
        ("the first group's scale for every group", [(" + k0 // GROUP_SIZE,", ",")]),
        ("odd k from the low nibble", [_swap_nibbles("offs_k[None, :]")]),
    ],
    "w4a16_gemm": [
        (
            "group scale never applied",
            [("acc += tl.dot(x, code) * scale[None, :]", "acc += tl.dot(x, code)")],
        ),
        ("odd k from the low nibble", [_swap_nibbles("offs_k[:, None]")]),
    ],
    "fp8_act_quant": [
        ("FNUZ maximum 240 instead of 448", [("448.0", "240.0")]),
        ("an all-zero row divides 0 by 0", [("s_div = tl.where(s == 0.0, 1.0, s)", "s_div = s")]),
    ],
    "fp8_gemm": [
        (
            "weight scale forgotten",
            [("out = acc * (sa[:, None] * sb[None, :])", "out = acc * sa[:, None]")],
        ),
        ("K tail not masked", [(" & mask_k[None, :]", ""), (" & mask_k[:, None]", "")]),
    ],
}


MUTANTS = build_mutants(_EDITS)
