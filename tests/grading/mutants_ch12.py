"""Known-wrong implementations for chapter 12 (outliers), merged into grading_bank.MUTANTS.
Each is the solution cell of solutions/12_outliers.ipynb with textual changes, so the bank
tracks the solution (an edit whose text is gone fails loudly at import).

MUTANTS[grade_id] = [(name, cell source), ...]; each must fail `check` on every seed and cost
exactly its task's points.
"""

from __future__ import annotations

from mutant_edits import build_mutants

SS = "s = a**alpha / w ** (1 - alpha)"
SS_RET = "return torch.where(dead, torch.ones_like(s), s).float()"
FW_RESHAPE = "y = x.reshape(-1, m, p).float()  # shape: (rows, m, 2^k)"
FW_RET = "return (y / math.sqrt(n)).reshape(x.shape)"
FW_MIX = 'y = torch.einsum("ij,rip->rjp", H12, y)'
I8_COLS = "cols = (x.abs() >= threshold).any(dim=0)  # outlier input channels, bool (K,)"
I8_Y16 = "y16 = x[:, cols].half().float() @ w[:, cols].half().float().T"
I8_SX = "s_x = (x8.abs().amax(dim=1) / 127).to(torch.float16).float()  # per token, shape (M,)"
I8_SW = "s_w = (w8.abs().amax(dim=1) / 127).to(torch.float16).float()  # per output channel, (N,)"
I8_QX = "q_x = torch.clamp(torch.round(x8 / torch.where(s_x == 0, 1.0, s_x)[:, None]), -127, 127)"
I8_QW = "q_w = torch.clamp(torch.round(w8 / torch.where(s_w == 0, 1.0, s_w)[:, None]), -127, 127)"


def _int8_rounding(rule: str) -> list[tuple[str, str]]:
    """Both code lines rounded by ``rule`` (a format string of the value v)."""
    out = []
    for line, v in ((I8_QX, "x8 / torch.where(s_x == 0, 1.0, s_x)[:, None]"),
                    (I8_QW, "w8 / torch.where(s_w == 0, 1.0, s_w)[:, None]")):
        out.append((line, line.replace(f"torch.round({v})", rule.format(v=f"({v})"))))
    return out


# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "smooth_scales": [
        ("S1 exponents swapped", [(SS, "s = a ** (1 - alpha) / w**alpha")]),
        ("S1 ratio inverted (weights over activations)", [(SS, "s = w ** (1 - alpha) / a**alpha")]),
        ("S2 no zero-channel rule: 0, inf or NaN left", [(SS_RET, "return s.float()")]),
        ("S3 returned as float64", [(SS_RET, SS_RET.replace(".float()", ""))]),
        (
            "S2 the paper code's clamp to 1e-5 instead of s = 1",
            [(SS, "s = a.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)"),
             (SS_RET, "return s.float()")],
        ),
        (
            "S2 zero rule only where both are zero",
            [("dead = (a == 0) | (w == 0)", "dead = (a == 0) & (w == 0)")],
        ),
    ],
    "fwht": [
        ("F1 not normalised", [(FW_RET, "return y.reshape(x.shape)")]),
        ("F1 divided by n, not sqrt(n)", [(FW_RET, "return (y / n).reshape(x.shape)")]),
        (
            "F1 12-point part not normalised (sqrt(2^k))",
            [(FW_RET, "return (y / math.sqrt(p)).reshape(x.shape)")],
        ),
        ("F3 H12 transposed", [(FW_MIX, 'y = torch.einsum("ji,rip->rjp", H12, y)')]),
        ("F3 12 blocks never mixed", [(FW_MIX, "pass")]),
        (
            "F3 Kronecker order swapped (H_2^k outside)",
            [(FW_RESHAPE, "y = x.reshape(-1, p, m).transpose(1, 2).float()"),
             (FW_RET, "return (y / math.sqrt(n)).transpose(1, 2).reshape(x.shape)")],
        ),
        (
            "F2 butterfly sign (b - a)",
            [("torch.stack((a + b, a - b), dim=-2)", "torch.stack((a + b, b - a), dim=-2)")],
        ),
        (
            "F4 forms the n x n matrix (the transform of eye(n)), then x @ H",
            [(FW_RESHAPE, "y = torch.eye(n).reshape(-1, m, p)"),
             (FW_RET, "return (x.reshape(-1, n).float() @ y.reshape(n, n) / math.sqrt(n))"
                      ".reshape(x.shape)")],
        ),
        (
            "F5 returned as float64",
            [("return (y / math.sqrt(n)).reshape(x.shape)",
              "return (y / math.sqrt(n)).reshape(x.shape).double()")],
        ),
    ],
    "llm_int8_matmul": [
        ("I1 |x| > threshold (strict)", [(I8_COLS, I8_COLS.replace(">=", ">"))]),
        ("I2 threshold fixed at 6", [(I8_COLS, I8_COLS.replace(">= threshold", ">= 6.0"))]),
        (
            "I1 outlier elements, not whole columns, in 16 bit",
            [(I8_COLS, "big = x.abs() >= threshold\n    cols = big.all(dim=0)"),
             (I8_Y16, "y16 = (x * big).half().float() @ w.half().float().T"),
             ("x8, w8 = x.masked_fill(cols, 0.0), w.masked_fill(cols, 0.0)",
              "x8, w8 = x.masked_fill(big, 0.0), w")],
        ),
        ("I3 outliers kept in float32", [(I8_Y16, "y16 = x[:, cols] @ w[:, cols].T")]),
        (
            "I4 int8 scales over whole rows (outliers included)",
            [(I8_SX, I8_SX.replace("x8.abs()", "x.abs()")),
             (I8_SW, I8_SW.replace("w8.abs()", "w.abs()"))],
        ),
        (
            "I4 one scale for all tokens (per tensor)",
            [(I8_SX, "s_x = (x8.abs().amax() / 127).to(torch.float16).float().expand(x.shape[0])")],
        ),
        (
            "I4 scales kept in float32",
            [(I8_SX, I8_SX.replace(".to(torch.float16)", "")),
             (I8_SW, I8_SW.replace(".to(torch.float16)", ""))],
        ),
        (
            "I6 w's outlier columns not zeroed before its scales",
            [("x8, w8 = x.masked_fill(cols, 0.0), w.masked_fill(cols, 0.0)",
              "x8, w8 = x.masked_fill(cols, 0.0), w")],
        ),
        (
            "I7 codes from the float32 scales (rescaled with the fp16 ones)",
            [(I8_QX, I8_QX.replace("torch.where(s_x == 0, 1.0, s_x)",
                                   "(x8.abs().amax(dim=1) / 127).clamp(min=1e-30)")),
             (I8_QW, I8_QW.replace("torch.where(s_w == 0, 1.0, s_w)",
                                   "(w8.abs().amax(dim=1) / 127).clamp(min=1e-30)"))],
        ),
        ("I8 round half away from zero",
         _int8_rounding("(torch.sign({v}) * torch.floor({v}.abs() + 0.5))")),
        ("I8 round half up", _int8_rounding("torch.floor({v} + 0.5)")),
        (
            "I8 multiply by the reciprocal 1 / s",
            [(I8_QX, I8_QX.replace("x8 / torch.where(s_x == 0, 1.0, s_x)",
                                   "x8 * (1 / torch.where(s_x == 0, 1.0, s_x))")),
             (I8_QW, I8_QW.replace("w8 / torch.where(s_w == 0, 1.0, s_w)",
                                   "w8 * (1 / torch.where(s_w == 0, 1.0, s_w))"))],
        ),
        (
            "I9 absmax rounded to float16 before the division",
            [(I8_SX, I8_SX.replace("x8.abs().amax(dim=1)", "x8.abs().amax(dim=1).half().float()")),
             (I8_SW, I8_SW.replace("w8.abs().amax(dim=1)", "w8.abs().amax(dim=1).half().float()"))],
        ),
        (
            "I5 no guard for all-zero rows (0 / 0)",
            [("torch.where(s_x == 0, 1.0, s_x)", "s_x"),
             ("torch.where(s_w == 0, 1.0, s_w)", "s_w")],
        ),
        (
            "I11 codes not clamped (a subnormal float16 scale passes 127)",
            [("q_x = torch.clamp(torch.round(x8 / torch.where(s_x == 0, 1.0, s_x)[:, None]), "
              "-127, 127)", "q_x = torch.round(x8 / torch.where(s_x == 0, 1.0, s_x)[:, None])")],
        ),
        (
            "I10 float64 output (the exact sums never cast back)",
            [("acc = (q_x.double() @ q_w.double().T).float()",
              "acc = q_x.double() @ q_w.double().T")],
        ),
    ],
}


MUTANTS = build_mutants(_EDITS)
