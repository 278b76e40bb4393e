"""Learner-side checks: one call in a notebook cell, immediate feedback."""

from __future__ import annotations

import os
import secrets
from typing import Callable

from qlab.grading import _harness
from qlab.grading.registry import _clone, evaluate, get_task, make_cases

__all__ = ["check", "CheckFailed", "GRADER_ENV"]

GRADER_ENV = "QLAB_GRADER_KERNEL"  # set in the kernels that `qlab grade` starts


class CheckFailed(AssertionError):
    """Raised by check() so that a failing check cell fails (nbgrader awards no points)."""


def check(grade_id: str, fn: Callable, seed: int | None = None, quiet: bool = False) -> bool:
    """Run ``fn`` on fresh random inputs and compare with qlab.

    Prints a pass line, or the first mismatch (which case, which element, expected vs
    got), and raises CheckFailed on failure. ``seed`` replays a run (the seed is printed).
    The values go through the same plain-data conversion as ``qlab grade``, so a return
    value the grader would refuse is refused here too.
    """
    __tracebackhide__ = True  # IPython and pytest: show the message, not check's frames
    if os.environ.get(GRADER_ENV):
        print(f"(check {grade_id} skipped: `qlab grade` runs its own checks)")
        return True
    task = get_task(grade_id)
    if seed is None:
        seed = secrets.randbits(63)
    cases = make_cases(task, seed)
    if not callable(fn):
        raise CheckFailed(f"{grade_id}: pass your function itself, got {type(fn).__name__}")
    # the student's function gets copies: mutating its inputs cannot change the reference's
    records = _harness.run_cases(fn, [_clone(c) for c in cases])
    result = evaluate(task, cases, records)
    if result.passed:
        if not quiet:
            print(f"PASS {grade_id} ({task.points} pt): {result.feedback} (seed {seed})")
        return True
    if records and "error" in records[0] and "NotImplementedError" in records[0]["error"]:
        msg = f"FAIL {grade_id}: {task.func_name} is not implemented yet"
    else:
        msg = f"FAIL {grade_id}: {result.feedback} (seed {seed})"
    print(msg)
    raise CheckFailed(msg)
