"""The task registry: grade_id -> (function name, points, inputs, reference, comparator).

A task is checked on FRESH inputs drawn from a seeded generator, against a reference
that calls qlab (the single source of truth; never a re-implementation here), by a
comparator that is bit-exact where the arithmetic is the same and states its tolerance
otherwise. The same Task object serves the learner's ``check`` cell and ``qlab grade``.
See README.md in this folder for how to add a task.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from qlab.grading import _harness

__all__ = [
    "Task",
    "register",
    "get_task",
    "all_tasks",
    "assignment_tasks",
    "assignments",
    "exact",
    "close",
    "compare_values",
    "evaluate",
    "TaskResult",
    "case_seed",
    "tasks_for",
    "Mismatch",
    "SizeLimit",
    "size_limits",
]

Case = tuple  # positional arguments of one call


@dataclass(frozen=True)
class Mismatch:
    """Where a result first differs: which output (a name from ``names``, or "output"), the
    index into it (``()`` for a scalar), and the two values there."""

    output: str
    index: tuple[int, ...]
    expected: Any
    got: Any


# explain(args, mismatch) -> the spec's intermediate quantities at that element (scale,
# zero point, x / s, whether it is a tie, the byte in hex...), or None
Explain = Callable[[Case, Mismatch], "str | None"]
Comparator = Callable[[Any, Any, Case], "str | None"]


def compare_values(
    expected: Any,
    got: Any,
    args: Case = (),
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    signed_zero: bool = False,
    names: tuple[str, ...] = (),
    path: str = "output",
    explain: Explain | None = None,
) -> str | None:
    """None when ``got`` matches ``expected``, else a hint naming the first bad element.

    Tensors: same shape and dtype (a Python number may stand for a 0-d tensor); floats
    match when |got - expected| <= atol + rtol * |expected| (0, 0: bit-exact values; NaN
    matches NaN; with ``signed_zero`` -0.0 and +0.0 differ). Tuples match element by element.
    ``explain`` adds what the spec computes at the first bad element; without it, the
    input with the output's shape is shown at that index (fine for elementwise tasks).
    """
    opts = dict(rtol=rtol, atol=atol, signed_zero=signed_zero, explain=explain)
    if isinstance(expected, tuple):
        if type(got) is not tuple or len(got) != len(expected):
            what = ", ".join(names) if names else f"{len(expected)} values"
            return f"{path}: expected a tuple ({what}), got {_kind(got)}"
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            sub = names[i] if i < len(names) else f"{path}[{i}]"
            hint = compare_values(e, g, args, path=sub, **opts)
            if hint:
                return hint
        return None
    if expected is None:
        return None if got is None else f"{path}: expected None, got {_kind(got)}"
    if isinstance(expected, (bool, int, float)):
        return _compare_number(expected, got, args, path, **opts)
    if not isinstance(expected, torch.Tensor):
        raise TypeError(f"reference returned {type(expected).__name__}; fix the task")
    return _compare_tensor(expected, got, args, path, **opts)


def _compare_number(expected, got, args, path, *, rtol, atol, signed_zero, explain):
    if type(got) in (bool, int, float):
        g = got
    elif isinstance(got, torch.Tensor) and got.numel() == 1:
        g = got.reshape(()).item()
    else:
        return f"{path}: expected a number, got {_kind(got)}"
    e_t = torch.tensor(expected, dtype=torch.float64)
    g_t = torch.tensor(g, dtype=torch.float64)
    if not _bad_mask(e_t, g_t, rtol, atol, signed_zero).item():
        return None
    note = _explained(explain, args, Mismatch(path, (), expected, g))
    return f"{path}: expected {expected!r}, got {g!r}" + _tol_note(rtol, atol) + note


def _compare_tensor(expected, got, args, path, *, rtol, atol, signed_zero, explain):
    number = type(got) in (int, float, bool) and expected.ndim == 0  # any dtype: a number
    if number:
        got = torch.tensor(got)
    if not isinstance(got, torch.Tensor):
        return f"{path}: expected a tensor of shape {tuple(expected.shape)}, got {_kind(got)}"
    if tuple(got.shape) != tuple(expected.shape):
        return (
            f"{path}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
            + _shape_note(args)
        )
    integer_ref = not expected.dtype.is_floating_point
    if integer_ref and got.dtype.is_floating_point:
        return (
            f"{path}: expected an integer tensor (like {expected.dtype}), got {got.dtype}; "
            "round, then cast with .to(...)"
        )
    if got.dtype != expected.dtype and not number:  # the spec names every output's dtype
        return (
            f"{path}: expected dtype {str(expected.dtype).removeprefix('torch.')}, got "
            f"{str(got.dtype).removeprefix('torch.')}; convert with .to(...)"
        )
    if integer_ref:
        bad = expected.to(torch.int64) != got.to(torch.int64)
    else:
        bad = _bad_mask(expected.to(torch.float64), got.to(torch.float64), rtol, atol, signed_zero)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), expected.shape))
    e_val, g_val = expected.reshape(-1)[flat].item(), got.reshape(-1)[flat].item()
    where = f"{path}[{', '.join(map(str, idx))}]" if idx else path
    msg = (
        f"{where}: expected {_fmt(e_val)}, got {_fmt(g_val)} "
        f"({n_bad} of {expected.numel()} elements differ)" + _tol_note(rtol, atol)
    )
    if explain is None:
        return msg + _input_note(args, expected.shape, idx)
    return msg + _explained(explain, args, Mismatch(path, idx, e_val, g_val))


def _explained(explain: Explain | None, args: Case, where: Mismatch) -> str:
    if explain is None:
        return ""
    try:
        note = explain(args, where)
    except Exception:  # noqa: BLE001 - an explanation must never hide the mismatch itself
        return ""
    return f"; {note}" if note else ""


def _bad_mask(e, g, rtol, atol, signed_zero):
    both_nan = torch.isnan(e) & torch.isnan(g)
    if rtol == 0 and atol == 0:
        ok = (e == g) | both_nan
    else:
        ok = ((g - e).abs() <= atol + rtol * e.abs()) | (e == g) | both_nan
    if signed_zero:
        ok &= ~((e == 0) & (g == 0) & (torch.signbit(e) != torch.signbit(g)))
    return ~ok


def _fmt(v: Any) -> str:
    return repr(v) if not isinstance(v, float) else f"{v!r}"


def _kind(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    if isinstance(v, tuple):
        return f"a tuple of {len(v)}"
    return type(v).__name__


def _tol_note(rtol: float, atol: float) -> str:
    return f" [tolerance rtol={rtol:g}, atol={atol:g}]" if (rtol or atol) else ""


def _shape_note(args: Case) -> str:
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    return f" (input shapes {shapes})" if shapes else ""


def _input_note(args: Case, shape: torch.Size, idx: tuple) -> str:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and tuple(a.shape) == tuple(shape) and idx:
            return f"; input arg {i} at that index = {_fmt(a[idx].item())}"
    return ""


def exact(
    names: tuple[str, ...] = (), signed_zero: bool = False, explain: Explain | None = None
) -> Comparator:
    """Bit-exact comparison of values (integers, and floats where the arithmetic is the same)."""

    def cmp(expected, got, args):
        return compare_values(
            expected, got, args, names=names, signed_zero=signed_zero, explain=explain
        )

    cmp.describe = "bit-exact"
    return cmp


def close(
    rtol: float, atol: float = 0.0, names: tuple[str, ...] = (), explain: Explain | None = None
) -> Comparator:
    """|got - expected| <= atol + rtol*|expected|; give the reason for the tolerance in the task."""

    def cmp(expected, got, args):
        return compare_values(
            expected, got, args, rtol=rtol, atol=atol, names=names, explain=explain
        )

    cmp.describe = f"rtol={rtol:g}, atol={atol:g}"
    return cmp


@dataclass(frozen=True)
class Task:
    """One graded task (one nbgrader grade cell).

    grade_id:   the id of the check cell (nbgrader ``grade_id``) and the CSV column.
    func_name:  the function the learner defines in the solution cell.
    points:     awarded only if every case matches.
    assignment: the notebook stem it belongs to, e.g. "01_affine".
    cases:      seeded generator -> list of positional-argument tuples (fresh inputs).
    reference:  *args -> expected value, calling qlab.
    compare:    (expected, got, args) -> None or a hint string.
    kernel_env: environment variables the grading kernel needs for this task (set when
                the kernel starts), e.g. {"TRITON_INTERPRET": "1"} for Triton exercises
                (which also marks a kernel task: its calls run under tasks/_bounds.py's
                out-of-bounds checker and, in ``check``, in a child process).
    implements: the qlab callables this task asks the learner to write, as dotted names
                ("qlab.quantize", "qlab.formats.minifloat.Minifloat.encode"). While the
                learner's function runs (``check`` and ``qlab grade``), calls to them and
                to the registry's references are recorded (``TaskResult.uses_reference``).
    size_limit: a rule of the spec about memory (e.g. fwht: never form the n x n matrix),
                checked while the learner's function runs (``check`` and ``qlab grade``):
                no tensor or array may hold more elements than it allows (SizeLimit).
    """

    grade_id: str
    func_name: str
    points: int
    assignment: str
    cases: Callable[[torch.Generator], list[Case]]
    reference: Callable[..., Any]
    compare: Comparator = field(default_factory=exact)
    signature: str = ""
    kernel_env: dict[str, str] = field(default_factory=dict)
    implements: tuple[str, ...] = ()
    size_limit: SizeLimit | None = None


@dataclass(frozen=True)
class SizeLimit:
    """The most elements one tensor or array may hold while the learner's function runs on
    a case (``elements(*case)``), and the spec's sentence it enforces (shown on a failure)."""

    elements: Callable[..., int]
    rule: str

    def per_case(self, cases: list[Case]) -> list[int]:
        return [int(self.elements(*c)) for c in cases]


def size_limits(task: Task, cases: list[Case]) -> tuple[list[int] | None, str]:
    """(per-case element limits, rule) for ``_harness.run_cases``; (None, "") without one."""
    if task.size_limit is None:
        return None, ""
    return task.size_limit.per_case(cases), task.size_limit.rule


_TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Add a task to the registry (module import time). grade_ids are unique."""
    old = _TASKS.get(task.grade_id)
    if old is not None and old is not task:
        raise ValueError(f"grade_id {task.grade_id!r} is registered twice")
    _TASKS[task.grade_id] = task
    return task


def tasks_for(assignment: str, **defaults: Any) -> Callable[..., Callable]:
    """A decorator factory for one task module: ``task = tasks_for("01_affine")``, then

        @task("sym_quantize", "symmetric_quantize", points=2, reference=..., compare=...)
        def _sym_cases(g): ...

    registers Task(grade_id, func_name, assignment=assignment, cases=<the function>, ...).
    ``defaults`` (e.g. kernel_env) apply to every task of the module. Declare next to the
    spec what the learner writes: ``implements=("qlab.quantize",)`` (see Task)."""

    def task(grade_id: str, func_name: str, **fields: Any) -> Callable:
        def decorate(cases: Callable[[torch.Generator], list[Case]]) -> Callable:
            register(
                Task(
                    grade_id=grade_id,
                    func_name=func_name,
                    assignment=assignment,
                    cases=cases,
                    **{**defaults, **fields},
                )
            )
            return cases

        return decorate

    return task


def _load() -> None:
    from qlab.grading import tasks  # noqa: F401  (imports every task module)


def get_task(grade_id: str) -> Task:
    _load()
    try:
        return _TASKS[grade_id]
    except KeyError:
        raise KeyError(f"no task {grade_id!r}; known: {sorted(_TASKS)}") from None


def all_tasks() -> dict[str, Task]:
    _load()
    return dict(_TASKS)


def assignments() -> dict[str, list[str]]:
    """assignment name -> its grade_ids in registration order."""
    out: dict[str, list[str]] = {}
    for t in all_tasks().values():
        out.setdefault(t.assignment, []).append(t.grade_id)
    return out


def assignment_tasks(name: str) -> list[Task]:
    ids = assignments().get(name)
    if not ids:
        raise KeyError(f"no assignment {name!r}; known: {sorted(assignments())}")
    return [_TASKS[i] for i in ids]


def case_seed(run_seed: int, *parts: str) -> int:
    """A 63-bit seed from the run seed and names (submission, task): stable, unguessable."""
    h = hashlib.sha256(str(run_seed).encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


@dataclass
class TaskResult:
    grade_id: str
    score: int
    max: int
    passed: bool
    feedback: str
    n_cases: int = 0
    failed_case: int | None = None  # index of the case that failed (None: passed, or no case)
    # the task's declared qlab functions / the registry's references that the learner's
    # function called while it was graded (_harness.watching)
    uses_reference: list[str] = field(default_factory=list)


def describe_args(args: Case) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{str(a.dtype).removeprefix('torch.')} tensor {tuple(a.shape)}")
        else:
            parts.append(repr(a))
    return "(" + ", ".join(parts) + ")"


def borrowed_in(records: list | None) -> list[str]:
    """The references the records say the learner's function called (sorted, validated)."""
    names = set()
    for rec in records if type(records) is list else []:
        got = rec.get("borrowed") if type(rec) is dict else None
        if type(got) is list:
            names.update(n[:200] for n in got if type(n) is str)
    return sorted(names)[:20]


def borrow_message(task: Task, names: list[str]) -> str:
    """What the learner and the instructor read when a function calls a reference."""
    shown = ", ".join(
        "the grader's own reference for a task" if n == _harness.REGISTRY_LABEL else n
        for n in names
    )
    return (
        f"{task.func_name} passes only because it calls {shown}; "
        "the exercise asks you to write it"
    )


def evaluate(
    task: Task,
    cases: list[Case],
    records: list[dict] | None,
    missing: str | None = None,
    forbid_reference: bool = False,
) -> TaskResult:
    """Score one task from the plain records its function produced (grader process).

    ``forbid_reference``: a function that called a reference (see Task.implements) scores 0
    with the reason; otherwise the call is only recorded in ``uses_reference``.
    """
    borrowed = borrowed_in(records)

    def fail(msg: str, case: int | None = None) -> TaskResult:
        result = TaskResult(task.grade_id, 0, task.points, False, msg, len(cases), case)
        result.uses_reference = borrowed
        return result

    if missing is not None:
        return fail(missing)
    if records is None or len(records) != len(cases):
        return fail("no result came back from the kernel")
    for i, (args, rec) in enumerate(zip(cases, records, strict=True)):
        label = f"case {i + 1} of {len(cases)} {task.func_name}{describe_args(args)}"
        if type(rec) is not dict:
            return fail(f"{label}: malformed result", i)
        if "error" in rec:
            return fail(f"{label} raised {str(rec['error'])[:600]}", i)
        try:
            got = _harness.decode(rec.get("ok"))
        except Exception as e:  # noqa: BLE001 - e.g. OverflowError from "0x1p99999": this task's
            return fail(f"{label}: could not read the result ({type(e).__name__}: {e})", i)
        expected = task.reference(*_clone(args))  # a failing reference is a task bug: raise
        try:
            hint = task.compare(expected, got, args)
        except Exception as e:  # noqa: BLE001 - odd values (e.g. bool vs complex) fail the case
            hint = f"could not compare the result ({type(e).__name__}: {e})"
        if hint:
            return fail(f"{label}: {hint}", i)
    if borrowed and forbid_reference:
        return fail(f"0 points (--forbid-reference): {borrow_message(task, borrowed)}")
    passed = f"passed {len(cases)} cases"
    if borrowed:
        passed += f"; {borrow_message(task, borrowed)}"
    return TaskResult(
        task.grade_id, task.points, task.points, True, passed, len(cases), None, borrowed
    )


def _clone(args: Case) -> Case:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def make_cases(task: Task, seed: int) -> list[Case]:
    g = torch.Generator().manual_seed(seed)
    return task.cases(g)
