"""Known-wrong implementations for chapter 13 (GPTQ and AWQ), merged into
grading_bank.MUTANTS. Each is the solution cell of solutions/13_gptq_awq.ipynb with one
textual change (an edit whose text is gone fails loudly at import), one per spec clause
listed in qlab/grading/tasks/ch13_gptq_awq.py; test_grading_check.py runs each through
`check` on 24 seeds, and each must fail on every one.

MUTANTS[grade_id] = [(name, cell source), ...]; each must cost exactly its task's points.
"""

from __future__ import annotations

from mutant_edits import build_mutants

DEAD = "h[dead, dead] = 1.0  # dead inputs: H_ii = 1 (their weights are zeroed elsewhere)\n"
DAMP = "h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)\n"
FACTOR = "return torch.linalg.cholesky(h_inv, upper=True)"
SCALE = "cols = w[:, i:i + group_size].float()"
ROUND = "torch.round(w[:, i].float() / s)"
UPDATE = "w[:, i:] -= err[:, i, None] * u[i, i:][None, :]"
MEAN_ABS = "mean_abs = x.abs().mean(dim=0)"
NORMALISE = "s = s / (s.max() * s.min()).sqrt()"

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "gptq_hinv": [
        ("H1 no fix for dead inputs (H_ii = 0 + damp)", [(DEAD, "pass\n")]),
        ("H5 h modified in place (no clone)", [("    h = h.clone()\n", "")]),
        (
            "H2 damped before the dead inputs are fixed (their 1s miss the mean)",
            [(DEAD + "    " + DAMP, DAMP + "    " + DEAD)],
        ),
        ("H3 absolute damp (H + damp I)", [("damp * torch.diag(h).mean() *", "damp *")]),
        ("H4 lower Cholesky factor of H^-1", [(FACTOR, "return torch.linalg.cholesky(h_inv)")]),
        (
            "H4 Cholesky factor of H, not of H^-1",
            [(FACTOR, "return torch.linalg.cholesky(h, upper=True)")],
        ),
        (
            "H6 U returned as float32",
            [("return torch.linalg.cholesky(h_inv, upper=True)",
              "return torch.linalg.cholesky(h_inv, upper=True).float()")],
        ),
    ],
    "gptq_block": [
        ("B1 round half away from zero",
         [(ROUND, "(torch.sign(w[:, i]) * torch.floor((w[:, i].float() / s).abs() + 0.5))")]),
        (
            "B2 scales kept in float32",
            [("scales = torch.zeros(n, b // group_size, dtype=torch.float16)",
              "scales = torch.zeros(n, b // group_size, dtype=torch.float32)"),
             (".to(torch.float16)", "")],
        ),
        (
            "B3 group scales from the block's input weights (the reference's W[:, j:j+g])",
            [("w = w.clone()", "w = w.clone()\n    w_in = w.clone()"),
             (SCALE, SCALE.replace("cols = w[", "cols = w_in["))],
        ),
        ("B4 err not divided by U_ii", [("(w[:, i] - q) / u[i, i]", "(w[:, i] - q)")]),
        ("B6 group scale computed in float64", [(SCALE, SCALE.replace(".float()", ""))]),
        ("B7 codes from a float64 division", [(ROUND, "torch.round(w[:, i] / s)")]),
        ("B8 w modified in place (no clone)", [("    w = w.clone()\n", "")]),
        ("B9 codes not clamped", [(f"torch.clamp({ROUND}, -qmax, qmax)", ROUND)]),
        ("B5 no update inside the block (RTN)", [(UPDATE, "pass")]),
        ("B5 update with column i of U (U^T)", [(UPDATE, UPDATE.replace("u[i, i:]", "u[i:, i]"))]),
        (
            "B10 codes returned as int64",
            [("codes = torch.zeros(n, b, dtype=torch.int8)",
              "codes = torch.zeros(n, b, dtype=torch.int64)")],
        ),
    ],
    "awq_scale": [
        ("A1 mean of x, not of |x|", [(MEAN_ABS, "mean_abs = x.mean(dim=0).abs()")]),
        ("A1 max |x| instead of the mean", [(MEAN_ABS, "mean_abs = x.abs().amax(dim=0)")]),
        ("A2 no clamp: a dead channel gets s = 0", [(".clamp(min=1e-4)", "")]),
        ("A3 not normalised", [(NORMALISE, "pass")]),
        ("A3 normalised by the largest scale", [(NORMALISE, "s = s / s.max()")]),
        ("A4 Q(W s) not divided back by s",
         [('qlab.fake_quantize(w * s, f"int{bits}", group_size) / s',
           'qlab.fake_quantize(w * s, f"int{bits}", group_size)')]),
        ("A5 error summed, not averaged", [("** 2).mean()", "** 2).sum()")]),
        (
            "A6 s returned as float64",
            [("return s, err.item()",
              "return s.double(), err.item()")],
        ),
    ],
}


MUTANTS = build_mutants(_EDITS)
