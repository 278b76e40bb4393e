"""Learner-side checks: one call in a notebook cell, immediate feedback.

    check("sym_quantize", symmetric_quantize)                   # PASS or FAIL (raises)
    case = check("sym_quantize", symmetric_quantize, show_case=True)
    symmetric_quantize(*case)                                   # replay the failing case

Kernel tasks (Triton) run the learner's function in a forked child process
(:mod:`qlab.grading.isolate`), as ``qlab grade`` runs it in a separate kernel: an
out-of-bounds store that kills the process becomes a FAIL line and the notebook keeps
its state.
"""

from __future__ import annotations

import importlib
import os
import secrets
from typing import Callable

from qlab.grading import _harness
from qlab.grading.isolate import can_fork, run_in_child
from qlab.grading.registry import (
    Task,
    _clone,
    borrow_message,
    describe_args,
    evaluate,
    get_task,
    make_cases,
    size_limits,
)

__all__ = ["check", "CheckFailed", "GRADER_ENV", "is_kernel_task", "kernel_guard"]

GRADER_ENV = "QLAB_GRADER_KERNEL"  # set in the kernels that `qlab grade` starts
CHECK_TIMEOUT_S = 120.0  # per check of a kernel task (the CPU interpreter is slow)
CRASH_HINT = "the usual cause is an unmasked tl.store (or a wrong stride)"
_GUARD_MODULE = "qlab.grading.tasks._bounds"  # Triton out-of-bounds checker, if present


class CheckFailed(AssertionError):
    """Raised by check() so that a failing check cell fails (nbgrader awards no points).

    ``.case`` holds the failing case's inputs (a tuple; ``fn(*err.case)`` replays it), or
    None when the failure is not about one case.
    """

    def __init__(self, message: str, case: tuple | None = None):
        super().__init__(message)
        self.case = case


def is_kernel_task(task: Task) -> bool:
    """A Triton task: its functions launch kernels (run on the CPU interpreter when graded)."""
    return "TRITON_INTERPRET" in task.kernel_env


def kernel_guard(task: Task):
    """The module whose ``checking()`` guards each call of a kernel task, or None."""
    if not is_kernel_task(task):
        return None
    try:
        module = importlib.import_module(_GUARD_MODULE)
    except ImportError:
        return None
    return module if callable(getattr(module, "checking", None)) else None


def crash_message(task: Task, how: str) -> str:
    """What a learner reads when their function ended the process running it."""
    if how.startswith("did not finish"):
        note = "an infinite loop?"
        if is_kernel_task(task):
            note += " In a kernel, an out-of-bounds tl.store can also corrupt memory and hang"
        return f"{task.func_name} {how} ({note})"
    if is_kernel_task(task):
        return f"the kernel crashed ({how}); {CRASH_HINT}"
    return f"{task.func_name} ended the process ({how})"


def check(
    grade_id: str,
    fn: Callable,
    seed: int | None = None,
    quiet: bool = False,
    show_case: bool = False,
    timeout: float = CHECK_TIMEOUT_S,
) -> tuple | None:
    """Run ``fn`` on fresh random inputs and compare with qlab.

    Prints a PASS line and returns None (a check cell shows no value, so nbgrader and
    otter see nothing but the printed line), or prints the first mismatch (which case,
    which element, expected vs got, the line of your code for an error) and raises
    CheckFailed. ``seed`` replays a run (the seed is printed). ``show_case=True``: on a
    failure, return the failing case's inputs instead of raising (``fn(*case)`` then
    replays it in the next cell). ``timeout``: seconds for a kernel task's child process.
    The values go through the same plain-data conversion as ``qlab grade``, so a return
    value the grader would refuse is refused here too. A function that calls the qlab
    function the task asks you to write (``Task.implements``) or the grader's reference
    fails, saying so.
    """
    __tracebackhide__ = True  # IPython and pytest: show the message, not check's frames
    if os.environ.get(GRADER_ENV):
        print(f"(check {grade_id} skipped: `qlab grade` runs its own checks)")
        return None
    task = get_task(grade_id)
    if seed is None:
        seed = secrets.randbits(63)
    cases = make_cases(task, seed)
    if not callable(fn):
        raise CheckFailed(f"{grade_id}: pass your function itself, got {type(fn).__name__}")
    _harness.install_watch(task.implements, getattr(fn, "__globals__", None))
    with _harness.watching(task.implements):
        records, crash = _run(task, fn, cases, timeout)
    result = evaluate(task, cases, records) if crash is None else None
    if result is not None and result.passed and not result.uses_reference:
        if not quiet:
            print(f"PASS {grade_id} ({task.points} pt): {result.feedback} (seed {seed})")
        return None
    if result is not None and result.passed:
        bad, msg = None, f"FAIL {grade_id}: {borrow_message(task, result.uses_reference)}"
    elif crash is not None:
        bad = len(records)  # the case that was running when the child died
        label = f"case {bad + 1} of {len(cases)} {task.func_name}{describe_args(cases[bad])}"
        msg = f"FAIL {grade_id}: {label}: {crash_message(task, crash)} (seed {seed})"
    elif records and "error" in records[0] and "NotImplementedError" in records[0]["error"]:
        bad, msg = 0, f"FAIL {grade_id}: {task.func_name} is not implemented yet"
    else:
        bad = _first_failing(task, cases, records, result)
        msg = f"FAIL {grade_id}: {result.feedback} (seed {seed})"
    print(msg)
    case = _clone(cases[bad]) if bad is not None else None
    if show_case:
        return case
    raise CheckFailed(msg, case)


def _run(task: Task, fn: Callable, cases: list, timeout: float) -> tuple[list, str | None]:
    """(records, crash): in a forked child for kernel tasks where possible, else here.

    The function gets copies: mutating its inputs cannot change the reference's.
    """
    guard = kernel_guard(task)
    factory = guard.checking if guard is not None else None
    limits, rule = size_limits(task, cases)
    copies = [_clone(c) for c in cases]
    if not is_kernel_task(task) or can_fork() is not None:
        return _harness.run_cases(fn, copies, factory, True, limits, rule), None
    child = run_in_child(fn, copies, timeout, factory, limits, rule)
    if child.output.strip():
        print(child.output.rstrip())
    if child.crash is not None and len(child.records) < len(cases):
        return child.records, child.crash
    return child.records, None


def _first_failing(task: Task, cases: list, records: list, result) -> int | None:
    """Index of the first case that fails on its own (None if only the whole set fails)."""
    index = getattr(result, "failed_case", None)
    if isinstance(index, int):
        return index
    if records is None or len(records) != len(cases):
        return None
    for i, (case, record) in enumerate(zip(cases, records, strict=True)):
        if not evaluate(task, [case], [record]).passed:
            return i
    return None
