"""Known-wrong implementations for chapter 14 (quantization-aware training), merged into
grading_bank.MUTANTS. Each is the solution cell of solutions/14_qat.ipynb with one textual
change (an edit whose text is gone fails loudly at import), one per spec clause listed in
qlab/grading/tasks/ch14_qat.py; test_grading_check.py runs each through `check` on 24
seeds, and each must fail on every one.

MUTANTS[grade_id] = [(name, cell source), ...]; each must cost exactly its task's points.
"""

from __future__ import annotations

from mutant_edits import build_mutants

STE_MASK = "inside = (blocks >= -qmax * scales) & (blocks <= qmax * scales)"
STE_BACK = "return torch.where(inside, grad_y, 0.0), None, None"
ROUND = "q = torch.clamp(torch.round(u), -qmax, qmax)"
ROUND_AWAY = "q = torch.clamp(torch.sign(u) * torch.floor(u.abs() + 0.5), -qmax, qmax)"
LSQ_INSIDE = "inside = (x >= -qmax * s) & (x <= qmax * s)"
LSQ_DS = "dy_ds = torch.where(inside, q - u, q)"
LSQ_SUM = "per_group = (grad_y * dy_ds).reshape(rows, k // ctx.n, ctx.n).sum(dim=-1)"
LSQ_GRAD_X = "grad_x = torch.where(inside, grad_y, 0.0)"
LSQ_RETURN = "return grad_x, ctx.grad_scale * per_group, None, None"



def _strict(line: str) -> str:
    return line.replace(">=", ">").replace("<=", "<")


# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "ste_fake_quantize": [
        ("T3 ends of the grid excluded (strict <)", [(STE_MASK, _strict(STE_MASK))]),
        ("T4 no mask: the gradient passes everywhere", [(STE_BACK, "return grad_y, None, None")]),
        (
            "T5 mask on round(u), torch.fake_quantize's convention",
            [(STE_MASK, "inside = (torch.round(u) >= -qmax) & (torch.round(u) <= qmax)")],
        ),
        (
            "T6 mask from x / s with s = 0: an all-zero group loses its gradient",
            [(STE_MASK, "inside = (blocks / scales >= -qmax) & (blocks / scales <= qmax)")],
        ),
        ("T1 scale kept in float32", [(".to(torch.float16).float()", "")]),
        ("T2 round half away from zero", [(ROUND, ROUND_AWAY)]),
        (
            "T8 multiply by the reciprocal 1 / s",
            [("u = blocks / torch.where(scales == 0, 1.0, scales)",
              "u = blocks * (1 / torch.where(scales == 0, 1.0, scales))")],
        ),
        (
            "T7 absmax rounded to float16 before the division",
            [("(blocks.abs().amax(dim=-1, keepdim=True) / qmax)",
              "(blocks.abs().amax(dim=-1, keepdim=True).half().float() / qmax)")],
        ),
        ("T9 y not clamped to +-qmax s", [(ROUND, "q = torch.round(u)")]),
    ],
    "lsq_quantize": [
        ("L2 grad_x passes everywhere, clamped values too", [(LSQ_GRAD_X, "grad_x = grad_y")]),
        ("L5 no gradient scale g", [(LSQ_RETURN, "return grad_x, per_group, None, None")]),
        (
            "L6 grad_scale argument ignored: LSQ's 1 / sqrt(N Q) instead",
            [("ctx.n, ctx.grad_scale = n, grad_scale",
              "ctx.n, ctx.grad_scale = n, (n * qmax) ** -0.5")],
        ),
        (
            "L3 0 inside the range (QIL / PACT-style step gradient)",
            [(LSQ_DS, "dy_ds = torch.where(inside, 0.0, q)")],
        ),
        ("L3 u - round(u): the sign flipped", [(LSQ_DS, "dy_ds = torch.where(inside, u - q, q)")]),
        ("L3 round(u) - u also where clamped", [(LSQ_DS, "dy_ds = q - u")]),
        (
            "L4 x == +-Q s counted as clamped (the paper's eq. 3 taken literally)",
            [(LSQ_INSIDE, _strict(LSQ_INSIDE))],
        ),
        (
            "L5 summed over the whole row, not per group",
            [(LSQ_SUM, "per_group = (grad_y * dy_ds).sum(dim=1, keepdim=True)"
                       ".expand(rows, k // ctx.n)")],
        ),
        ("L5 mean over the group, not the sum", [(LSQ_SUM, LSQ_SUM.replace(".sum(", ".mean("))]),
        ("L1 round half away from zero", [(ROUND, ROUND_AWAY)]),
        ("L7 multiply by the reciprocal 1 / s", [("u = x / s", "u = x * (1 / s)")]),
        ("L8 range tested on u = x / s against Q", [(LSQ_INSIDE, "inside = u.abs() <= qmax")]),
        ("L1 y not clamped to [-Q, Q]", [(ROUND, "q = torch.round(u)")]),
    ],
}

MUTANTS = build_mutants(_EDITS)
