"""Predict, then check: the learner writes a guess into a variable, the notebook compares.

    my_guess = None          # the learner replaces None with a number (or a choice)
    ...                      # the notebook computes the answer
    check_prediction(my_guess, answer, rel_tol=0.1, note="the usual wrong guess is ...")

A guess of None (the default, so the notebook still runs top to bottom unattended)
just shows the answer. Numbers (and lists of numbers, element by element) are
compared with a relative and/or absolute tolerance, choices (strings) without case
or surrounding spaces.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_prediction"]


def _is_close(guess: float, answer: float, rel_tol: float, abs_tol: float) -> bool:
    return math.isclose(guess, answer, rel_tol=rel_tol, abs_tol=abs_tol)


def check_prediction(guess, answer, rel_tol: float = 0.1, abs_tol: float = 0.0,
                     note: str = "") -> bool | None:
    """Print the guess next to the answer; True/False whether they agree, None if no guess.

    guess: None, a number, a list of numbers or a string (a choice such as "a"); answer:
        the same kind.
    rel_tol / abs_tol: how close a number must be (math.isclose); ignored for choices.
    note: shown after the verdict, e.g. the usual wrong guess and why it is wrong.
    """
    shown = f"{answer:.4g}" if isinstance(answer, numbers.Real) else repr(answer)
    if guess is None:
        verdict, correct = f"No prediction entered. The answer: {shown}.", None
    elif isinstance(answer, (list, tuple)):
        correct = (isinstance(guess, (list, tuple)) and len(guess) == len(answer)
                   and all(_is_close(float(g), float(a), rel_tol, abs_tol)
                           for g, a in zip(guess, answer, strict=True)))
        verdict = f"You predicted {list(guess)}; the answer is {list(answer)}: " + (
            "right." if correct else "not quite.")
    elif isinstance(answer, str):
        correct = str(guess).strip().lower() == answer.strip().lower()
        verdict = f"You chose {guess!r}; the answer is {shown}: " + (
            "right." if correct else "not this time.")
    elif isinstance(guess, numbers.Real) and not isinstance(guess, bool):
        correct = _is_close(float(guess), float(answer), rel_tol, abs_tol)
        off = "" if correct or answer == 0 else f" ({float(guess) / float(answer):.2g}x the answer)"
        verdict = f"You predicted {guess:.4g}; the answer is {shown}: " + (
            "close enough." if correct else f"off{off}.")
    else:
        raise TypeError(f"a prediction is a number or a choice (str), got {type(guess).__name__}"
                        f" {guess!r}; write e.g. my_guess = 0.5")
    print(verdict + (f"\n{note}" if note else ""))
    return correct
