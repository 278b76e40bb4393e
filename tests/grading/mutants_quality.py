"""Known-wrong implementations for chapter 07 (measuring quality), merged into
grading_bank.MUTANTS. Each is the solution cell of solutions/07_quality.ipynb with one
textual change, so the bank tracks the solution (an edit whose text is gone fails loudly at
import).

MUTANTS[grade_id] = [(name, cell source), ...]; each must cost exactly its task's points.
test_grading_check.py runs every one through `check` on several seeds.
"""

from __future__ import annotations

from mutant_edits import build_mutants

PPL_RETURN = "return math.exp(nll.mean().item())"
KL_SUM = "kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)"
KL_RETURN = "return kl.mean().item()"
FLIPPED = "flipped = a_logits.argmax(dim=-1) != b_logits.argmax(dim=-1)"

# grade_id -> [(name, [(old, new), ...])]: every `old` must occur in the solution cell.
_EDITS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "perplexity": [
        ("Q2 no exp: the mean NLL (cross-entropy)", [(PPL_RETURN, "return nll.mean().item()")]),
        ("Q2 2 ** NLL in nats (log bases mixed)", [(PPL_RETURN, "return 2 ** nll.mean().item()")]),
        ("Q1 targets not shifted", [("targets = windows[:, 1:]", "targets = windows[:, :-1]")]),
        (
            "Q2 mean of per-window perplexities",
            [(PPL_RETURN, "return nll.mean(dim=1).exp().mean().item()")],
        ),
        (
            "Q2 NLL in bits, then exp",
            [(PPL_RETURN, "return math.exp(nll.mean().item() / math.log(2))")],
        ),
        (
            "Q3 log(softmax): a target probability underflows to log 0",
            [("torch.log_softmax(logits, dim=-1)", "torch.log(torch.softmax(logits, dim=-1))")],
        ),
    ],
    "kl_divergence": [
        (
            "K1 KL(Q || P): the wrong direction",
            [(KL_SUM, "kl = (log_q.exp() * (log_q - log_p)).sum(dim=-1)")],
        ),
        (
            "K2 log base 2 (bits, not nats)",
            [(KL_RETURN, "return (kl / math.log(2)).mean().item()")],
        ),
        ("K2 sum over positions, not mean", [(KL_RETURN, "return kl.sum().item()")]),
        (
            "K3 log(softmax) underflows to log 0",
            [
                ("torch.log_softmax(p_logits, dim=-1)", "torch.log(torch.softmax(p_logits, -1))"),
                ("torch.log_softmax(q_logits, dim=-1)", "torch.log(torch.softmax(q_logits, -1))"),
            ],
        ),
        (
            "K3 log(softmax) with nan_to_num",
            [
                (
                    "torch.log_softmax(p_logits, dim=-1)",
                    "torch.nan_to_num(torch.log(torch.softmax(p_logits, -1)))",
                ),
                (
                    "torch.log_softmax(q_logits, dim=-1)",
                    "torch.nan_to_num(torch.log(torch.softmax(q_logits, -1)))",
                ),
            ],
        ),
    ],
    "flip_rate": [
        (
            "R1 equal argmax counted as flips (the agreement rate)",
            [(FLIPPED, FLIPPED.replace("!=", "=="))],
        ),
        (
            "R1 any changed logit counted as a flip",
            [(FLIPPED, "flipped = (a_logits != b_logits).any(dim=-1)")],
        ),
        (
            "R2 number of flips, not the fraction",
            [("flipped.double().mean().item()", "flipped.double().sum().item()")],
        ),
    ],
}


MUTANTS = build_mutants(_EDITS)
