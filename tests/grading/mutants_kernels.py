"""Known-wrong kernels for the Triton exercises (chapters 08-10), merged into
grading_bank.MUTANTS: one per spec clause listed in qlab/grading/tasks/ch08..ch10 (the
clause id starts each name), plus classic mistakes. Each is the solution cell with one
textual change, so the bank tracks the solutions (an edit whose text is gone fails loudly
at import). The unmasked loads are caught by the interpreter's bounds check
(qlab/grading/tasks/_bounds.py): their results are right.

MUTANTS[grade_id] = [(name, cell source), ...]. tests/kernels/test_kernel_exercises.py
checks them in-process and grades a class of kernel submissions end to end.
"""

from __future__ import annotations

from mutant_edits import build_mutants

SIGN = ("code = tl.where(nibble >= 8, nibble - 16, nibble)", "code = nibble")
ACT_LOAD = "mask=offs < K, other=0.0)"
ACT_Q = "q = round_to_e4m3(tl.div_rn(x, s_div))"


def _swap_nibbles(k: str) -> tuple[str, str]:
    """The odd element read from the low nibble: the classic packing bug."""
    return f"(({k} % 2) * 4)", f"((1 - {k} % 2) * 4)"


# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "triton_unpack_int4": [
        ("T1 odd column from the low nibble", [_swap_nibbles("cols[None, :]")]),
        ("T2 no sign extension", [SIGN]),
        (
            "T3 masked store, unmasked load",
            [("cols[None, :] // 2, mask=mask, other=0)", "cols[None, :] // 2)")],
        ),
        ("T3 unmasked store", [("code.to(tl.int8), mask=mask)", "code.to(tl.int8))")]),
    ],
    "triton_dequant": [
        (
            "D1 group index from the byte column",
            [("cols[None, :] // GROUP_SIZE", "(cols[None, :] // 2) // GROUP_SIZE")],
        ),
        ("D2 no sign extension", [SIGN]),
        ("D2 odd column from the low nibble", [_swap_nibbles("cols[None, :]")]),
        (
            "D3 one scale per 128-wide tile",
            [("cols[None, :] // GROUP_SIZE", "(tl.program_id(1) * BLOCK_K) // GROUP_SIZE")],
        ),
        ("D4 masked store, unmasked scale load", [("mask=mask, other=0.0)", ")")]),
    ],
    "w4a16_gemv": [
        ("W2 the first group's scale for every group", [(" + k0 // GROUP_SIZE,", ",")]),
        ("W3 odd k from the low nibble", [_swap_nibbles("offs_k[None, :]")]),
        ("W1 scale column k0 // BLOCK_K", [("k0 // GROUP_SIZE", "k0 // BLOCK_K")]),
        ("W4 weight rows past N loaded unmasked", [("mask=mask_n[:, None], other=0)", ")")]),
    ],
    "w4a16_gemm": [
        (
            "W2 group scale never applied",
            [("acc += tl.dot(x, code) * scale[None, :]", "acc += tl.dot(x, code)")],
        ),
        ("W3 odd k from the low nibble", [_swap_nibbles("offs_k[:, None]")]),
        ("W1 scale column k0 // BLOCK_K", [("k0 // GROUP_SIZE", "k0 // BLOCK_K")]),
        ("W4 rows of x past M loaded unmasked", [("mask=mask_m[:, None], other=0.0)", ")")]),
    ],
    "fp8_act_quant": [
        ("A3 FNUZ maximum 240 instead of 448", [("448.0", "240.0")]),
        (
            "A6 an all-zero row divides 0 by 0",
            [("s_div = tl.where(s == 0.0, 1.0, s)", "s_div = s")],
        ),
        (
            "A1 amax of the last K tile only",
            [("amax = tl.maximum(amax, tl.abs(x))", "amax = tl.abs(x)")],
        ),
        ("A2 masked stores, unmasked loads", [(ACT_LOAD, ")")]),
        (
            "A3 s = amax * (1 / 448)",
            [
                (
                    "s = tl.div_rn(tl.max(amax, axis=0), 448.0)",
                    "s = tl.max(amax, axis=0) * (1.0 / 448.0)",
                )
            ],
        ),
        ("A4 x * (1 / s)", [(ACT_Q, "q = round_to_e4m3(x * tl.div_rn(1.0, s_div))")]),
        ("A5 a plain cast instead of round_to_e4m3", [(ACT_Q, "q = tl.div_rn(x, s_div)")]),
    ],
    "fp8_gemm": [
        (
            "G3 weight scale forgotten",
            [("out = acc * (sa[:, None] * sb[None, :])", "out = acc * sa[:, None]")],
        ),
        ("G1 K tail not masked", [(" & mask_k[None, :]", ""), (" & mask_k[:, None]", "")]),
        ("G2 rows of a past M loaded unmasked", [("mask=mask_m[:, None] & mask_k", "mask=mask_k")]),
    ],
}


MUTANTS = build_mutants(_EDITS)
