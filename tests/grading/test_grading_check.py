"""Learner-side check() and the comparators: solutions pass, every mutant fails on every
seed (each spec clause of a task has a fixed case in every run), feedback names the spec's
intermediate quantities."""

from __future__ import annotations

import importlib
import math
import re

import pytest
import torch
from grading_bank import MUTANTS, SOLUTIONS, grade_id, load, with_cells

from qlab.grading import CheckFailed, Task, all_tasks, assignments, check, registry
from qlab.grading import _harness as wire
from qlab.grading.notebook import is_grade_cell
from qlab.grading.registry import compare_values, evaluate, make_cases, tasks_for

SEEDS = tuple(range(1, 13))  # solutions
# Mutants: many seeds, as the inputs differ per seed and a clause must fail on every one.
# Kernel tasks run under the Triton interpreter in a forked child (seconds per check):
# fewer seeds, on the same fixed edge cases.
MUTANT_SEEDS = tuple(range(100, 124))
KERNEL_SEEDS = tuple(range(1, 5))
KERNEL_MUTANT_SEEDS = tuple(range(100, 103))


def _namespace(nb) -> dict:
    ns: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and not is_grade_cell(cell):
            exec(compile(cell.source, f"<{grade_id(cell)}>", "exec"), ns)
    return ns


def _owner(gid: str) -> str:
    return all_tasks()[gid].assignment


@pytest.mark.parametrize("gid", sorted(all_tasks()))
def test_solution_passes_on_many_seeds(gid, capsys):
    task = all_tasks()[gid]
    ns = _namespace(load(task.assignment))
    seeds = KERNEL_SEEDS if task.kernel_env else SEEDS
    for seed in seeds:
        assert check(gid, ns[task.func_name], seed=seed) is None  # no value: nbgrader-quiet
    assert capsys.readouterr().out.count("PASS") == len(seeds)


MUTANT_IDS = [(g, i) for g in sorted(MUTANTS) for i in range(len(MUTANTS[g]))]


@pytest.mark.parametrize("gid,i", MUTANT_IDS, ids=[f"{g}-{i}" for g, i in MUTANT_IDS])
def test_mutant_fails_on_every_seed(gid, i, capsys, monkeypatch):
    _assert_fails_for_its_own_reason(gid, *MUTANTS[gid][i], capsys, monkeypatch)


def _assert_fails_for_its_own_reason(gid, name, source, capsys, monkeypatch):
    """It fails on every seed (a wrong value, an error or a crash; never a NameError or a
    stub), without calling its task's `implements` or any task's registry reference (not
    seen in a check that ends in a crash); and swapped alone into the solution
    notebook, its cell breaks no other task: they pass on one seed (kernel tasks, chapters
    08-10, are not rerun for this)."""
    task = all_tasks()[gid]
    # as `qlab grade` does, wrap the references before the cells run, so that a cell that
    # holds one where check() cannot rebind it (a default argument, a closure, a dict or a
    # functools.partial holding qlab.quantize) is seen too
    wire.install_watch(sorted({n for g in assignments()[task.assignment]
                               for n in all_tasks()[g].implements}))  # fmt: skip
    ns = _namespace(with_cells(load(task.assignment), {f"{gid}_solution": source}))
    borrowed = []

    def spy(*args, **kwargs):  # check()'s evaluate: reports the reference calls recorded
        result = evaluate(*args, **kwargs)
        borrowed.extend(result.uses_reference)
        return result

    monkeypatch.setattr(importlib.import_module("qlab.grading.check"), "evaluate", spy)
    seeds = KERNEL_MUTANT_SEEDS if task.kernel_env else MUTANT_SEEDS
    for seed in seeds:
        with pytest.raises(CheckFailed):
            check(gid, ns[task.func_name], seed=seed, quiet=True)
    out = capsys.readouterr().out
    assert out.count("FAIL") == len(seeds), name
    assert "expected" in out or "raised" in out or "crashed" in out, name
    assert "NameError" not in out and "not implemented" not in out, f"broken mutant: {name}"
    assert not borrowed, f"{name} calls {sorted(set(borrowed))}"
    for other in assignments()[task.assignment]:
        if other != gid and not all_tasks()[other].kernel_env:
            check(other, ns[all_tasks()[other].func_name], seed=seeds[0], quiet=True)


# Two mutants a bank must not hold. Run alone (`-k refused`), "borrows" also shows that the
# helper's early wrap is needed: without it, this test fails. That holds because "borrows"
# sorts before "breaks_asym", whose check() of sym_quantize wraps qlab.quantize for the
# process, as any earlier check() in a whole session does.
BAD_MUTANTS = {  # id -> (sym_quantize's cell, a pattern the refusal's message contains)
    # wrong (a float32 scale), and it borrows qlab.quantize through a default argument
    "borrows": (
        "import qlab\n"
        "def symmetric_quantize(x, bits, _q=qlab.quantize):\n"
        "    qt = _q(x, qlab.int_scheme(bits))\n"
        "    return qt.codes, qt.scales.float()\n",
        r"borrows calls \[.*'qlab\.quantize'",
    ),
    # wrong (torch is None when it runs), and asym_quantize, which reads the same global
    # torch when called, fails too (the later cells still define their functions: their
    # annotations, torch.Tensor, are not evaluated, as the cells compile under this file's
    # `from __future__ import annotations`)
    "breaks_asym": (
        "def symmetric_quantize(x, bits):\n"
        "    return torch.zeros_like(x, dtype=torch.int8), torch.tensor(0.5)\n"
        "torch = None\n",
        r"FAIL asym_quantize: .*AttributeError: 'NoneType'",
    ),
}


@pytest.mark.parametrize("why", sorted(BAD_MUTANTS))
def test_a_mutant_that_borrows_or_breaks_another_task_is_refused(why, capsys, monkeypatch):
    source, says = BAD_MUTANTS[why]
    with pytest.raises(AssertionError, match=says):  # CheckFailed is an AssertionError
        _assert_fails_for_its_own_reason("sym_quantize", why, source, capsys, monkeypatch)


def _clauses(module) -> set[str]:
    """Clause ids (S1, A3, ...) listed in a task module's docstring, one per line start."""
    return set(re.findall(r"^\s+([A-Z]\d+) ", module.__doc__ or "", flags=re.M))


TASK_MODULES = sorted({t.cases.__module__ for t in all_tasks().values()})


@pytest.mark.parametrize("module_name", TASK_MODULES)
def test_every_listed_clause_has_a_mutant(module_name):
    """Each clause a task module lists has a mutant named after it."""
    module = importlib.import_module(module_name)
    gids = [g for g, t in all_tasks().items() if t.cases.__module__ == module_name]
    named = {n.split(" ", 1)[0].rstrip(":") for g in gids for n, _ in MUTANTS.get(g, [])}
    clauses = _clauses(module)
    assert clauses, f"{module_name} lists no spec clauses"
    assert clauses <= named, f"clauses without a mutant: {sorted(clauses - named)}"


def test_every_task_has_mutants_and_a_solution_notebook():
    """Every registered task needs a solution notebook and >= 2 known-wrong implementations
    (grading_bank.MUTANTS, merged from the tests/grading/mutants_*.py modules)."""
    no_notebook = [a for a in assignments() if not (SOLUTIONS / f"{a}.ipynb").exists()]
    few = [g for gids in assignments().values() for g in gids if len(MUTANTS.get(g, [])) < 2]
    assert not no_notebook, f"assignments without solutions/<name>.ipynb: {no_notebook}"
    assert not few, f"tasks with fewer than 2 known-wrong implementations: {few}"


def test_stub_reports_not_implemented(capsys):
    def symmetric_quantize(x, bits):
        raise NotImplementedError()

    with pytest.raises(CheckFailed, match="not implemented"):
        check("sym_quantize", symmetric_quantize)


def test_hint_names_element_expected_and_got(capsys):
    ns = _namespace(with_cells(load("06_wxay"), {"pack_int4_solution": MUTANTS["pack_int4"][0][1]}))
    with pytest.raises(CheckFailed) as err:
        check("pack_int4", ns["pack_int4"], seed=7)
    msg = str(err.value)
    assert "case 1 of" in msg and "expected" in msg and "got" in msg and "[0, " in msg
    assert "seed 7" in msg


def test_fresh_inputs_every_call():
    task = all_tasks()["sym_quantize"]
    a, b = make_cases(task, 1), make_cases(task, 2)
    assert not torch.equal(a[0][0], b[0][0]) or a[0][0].shape != b[0][0].shape
    assert all(torch.equal(x[0], y[0]) for x, y in zip(make_cases(task, 1), a, strict=True))


def test_a_pasted_answer_fails():
    task = all_tasks()["sym_quantize"]
    seen = make_cases(task, 11)
    answers = [task.reference(*c) for c in seen]

    def symmetric_quantize(x, bits):  # replays answers seen once
        return answers[0]

    with pytest.raises(CheckFailed):
        check("sym_quantize", symmetric_quantize, seed=12)


# ---- the wire format: only plain data crosses, nothing that can lie ------------------------


class _Liar:
    def __eq__(self, other):
        return True

    def __array__(self, dtype=None, copy=None):
        raise AssertionError("never asked")


class _LyingTensor(torch.Tensor):
    def __eq__(self, other):
        return torch.ones_like(other, dtype=torch.bool)


@pytest.mark.parametrize(
    "value",
    [
        _Liar(),
        _LyingTensor(torch.zeros(3)),
        torch.nn.Parameter(torch.zeros(3)),
        {"a": 1},
        type("F", (float,), {"__eq__": lambda s, o: True})(1.0),
        torch.zeros(2, dtype=torch.complex64),
    ],
)
def test_wire_refuses_objects_that_could_lie(value):
    with pytest.raises(wire.WireError):
        wire.encode(value)


def test_wire_roundtrip_is_exact():
    t = torch.tensor([-0.0, float("nan"), float("inf"), 1e-45, 448.0])
    back = wire.loads(
        wire.dumps(
            (
                t,
                3,
                2.5,
                None,
                torch.arange(6, dtype=torch.int8),
                torch.tensor(1.5, dtype=torch.float16),
            )
        )
    )
    assert torch.equal(back[0].view(torch.int32)[[0, 2, 3, 4]], t.view(torch.int32)[[0, 2, 3, 4]])
    assert math.isnan(back[0][1])
    assert back[1:4] == (3, 2.5, None)
    assert back[4].dtype == torch.int8 and back[5].shape == () and back[5].dtype == torch.float16


@pytest.mark.parametrize(
    "bad",
    [
        {"__tensor__": "float32", "shape": [3], "data": "AAAA"},  # bytes != shape
        {"__tensor__": "object", "shape": [1], "data": "AAAAAA=="},  # dtype not allowed
        {"__tensor__": "int8", "shape": [-1], "data": ""},
        {"__float__": 1.0},
        [1, 2],
        {"__seq__": "x"},
        {"other": 1},
    ],
)
def test_wire_decode_validates(bad):
    with pytest.raises((wire.WireError, ValueError)):
        wire.decode(bad)


def test_evaluate_refuses_lying_records():
    task = all_tasks()["pack_int4"]
    cases = make_cases(task, 3)
    lying = [{"ok": {"__eq__": "True"}}] * len(cases)
    assert not evaluate(task, cases, lying).passed
    assert not evaluate(task, cases, [{"ok": None}] * len(cases)).passed
    assert not evaluate(task, cases, []).passed


def test_compare_values():
    e = torch.tensor([1.0, -0.0, float("nan")])
    assert compare_values(e, e.clone()) is None
    assert compare_values(e, torch.tensor([1.0, 0.0, float("nan")])) is None
    assert "output[1]: expected -0.0, got 0.0" in compare_values(
        e, torch.tensor([1.0, 0.0, float("nan")]), signed_zero=True
    )
    assert "expected shape" in compare_values(e, torch.zeros(2))
    assert "integer tensor" in compare_values(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    assert "expected dtype int8, got int64" in compare_values(
        torch.tensor([1, 2], dtype=torch.int8), torch.tensor([1, 2])
    )
    assert "expected dtype float32, got float64" in compare_values(e, e.double())
    assert compare_values(torch.tensor(3, dtype=torch.uint8), 3) is None  # a number: any dtype
    hint = compare_values(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1]), rtol=1e-3)
    assert "output[1]" in hint and "rtol" in hint
    assert compare_values(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0001]), rtol=1e-3) is None
    assert "tuple" in compare_values((e, e), e)
    assert compare_values(4.15625, 4.15625) is None and compare_values(4.0, 4.5) is not None


def test_mutating_the_inputs_cannot_fake_a_pass():
    def symmetric_quantize(x, bits):  # zero the input in place, then "agree" with it
        x.zero_()
        return torch.zeros_like(x, dtype=torch.int8), torch.tensor(0.0, dtype=torch.float16)

    with pytest.raises(CheckFailed):
        check("sym_quantize", symmetric_quantize, seed=5)


# ---- the task decorator and the per-task explanations ---------------------------------------


def test_tasks_for_registers_like_task_and_register():
    task = tasks_for("99_demo", points=1, reference=lambda x: x)

    @task("demo_echo", "echo", signature="echo(x) -> x")
    def _cases(g):
        return [(torch.randn(3, generator=g),)]

    try:
        registered = registry._TASKS["demo_echo"]
        assert registered == Task(
            grade_id="demo_echo",
            func_name="echo",
            points=1,
            assignment="99_demo",
            cases=_cases,
            reference=registered.reference,
            compare=registered.compare,
            signature="echo(x) -> x",
        )
        assert _cases(torch.Generator().manual_seed(0))[0][0].shape == (3,)  # still a function
    finally:
        del registry._TASKS["demo_echo"]


def _feedback(gid: str, mutant_name: str, seed: int = 3) -> str:
    source = dict(MUTANTS[gid])[mutant_name]
    task = all_tasks()[gid]
    ns = _namespace(with_cells(load(task.assignment), {f"{gid}_solution": source}))
    with pytest.raises(CheckFailed) as err:
        check(gid, ns[task.func_name], seed=seed)
    return str(err.value)


@pytest.mark.parametrize(
    "gid,mutant,words",
    [
        # a rounding failure names the scale, x / s and the tie
        ("sym_quantize", "S5 round half up: floor(x / s + 0.5)", ("s = ", "x / s = ", "a tie")),
        ("asym_quantize", "A4 zero point rounded half up", ("-lo / s = ", "a tie", "so z = ")),
        ("group_quantize", "G5 round half up", ("group 0", "w / s = ", "a tie")),
        ("nf4_quantize", "N4 midpoint ties take the upper code", ("exactly ON the midpoint",)),
        ("e4m3_encode", "C2 ties toward zero", ("halfway", "round-half-to-even")),
        ("mxfp4_quantize", "M2 E2M1 ties go up", ("x / X = ", "a tie")),
        ("mx_scale", "X2 exponent from torch.log2 (off by one below powers of two)", ("bits",)),
        ("nvfp4_quantize", "V3 E4M3 block scale ties go up", ("(block amax / 6) / ts", "a tie")),
        # packing shows the byte in hex
        ("pack_int4", "P1 wrong nibble order", ("expected byte 0x", "low nibble")),
        ("unpack_int4", "U1 wrong nibble order", ("byte packed[", "0x")),
        ("triton_unpack_int4", "T1 odd column from the low nibble", ("nibble of byte", "0x")),
        # a matmul output has no input at its index: the note is about the output's terms
        ("w8a8_matmul", "W4 round half up", ("integer sum over k", "s_x[", "exact ties")),
        ("w4a16_gemv", "W2 the first group's scale for every group", ("groups", "scales[")),
        ("kl_divergence", "K3 log(softmax) with nan_to_num", ("exactly 0", "log_softmax")),
        # a pinned arithmetic order: the feedback names the operation that differs
        ("sym_quantize", "S4 multiply by the reciprocal 1 / s", ("x * (1 / s) = ", "divide")),
        ("group_quantize", "G4 multiply by the reciprocal", ("w * (1 / s) = ", "divide")),
        ("asym_quantize", "A9 hi - lo rounded to float16 before the division",
         ("fp16(hi - lo) / ", "round the quotient to float16 once")),
        ("group_quantize", "G3 codes from the unrounded float32 scales", ("unrounded float32",)),
        ("w8a8_matmul", "W4 multiply by the reciprocal", ("v * (1 / s) rounds otherwise",)),
        ("llm_int8_matmul", "I8 multiply by the reciprocal 1 / s", ("v * (1 / s) rounds",)),
        ("gptq_block", "B6 group scale computed in float64", ("in float64, fp16(amax",)),
        ("gptq_block", "B7 codes from a float64 division", ("in float64, w / s = ", "a tie")),
        ("lsq_quantize", "L7 multiply by the reciprocal 1 / s", ("x * (1 / s) = ", "a tie")),
        ("lsq_quantize", "L8 range tested on u = x / s against Q",
         ("(float32), u = x / s = ", "comparing u = x / s with Q decides otherwise")),
        ("sym_quantize", "S8 codes not clamped (a subnormal float16 scale passes qmax)",
         ("beyond the grid: the clamp gives",)),
        ("ste_fake_quantize", "T9 y not clamped to +-qmax s",
         ("beyond the grid: the clamp gives",)),
        ("ste_fake_quantize", "T8 multiply by the reciprocal 1 / s", ("x * (1 / s) = ", "a tie")),
        ("ste_fake_quantize", "T7 absmax rounded to float16 before the division",
         ("fp16(amax) / ", "divide the float32 absmax")),
        ("ste_fake_quantize", "T5 mask on round(u), torch.fake_quantize's convention",
         ("ends included", "testing round(u) instead of x")),
        ("q4_0_decode", "D5: the product in float16", ("in float16 it would be", "nibble of byte")),
        ("q4_k_scales", "K4: the products in float16", ("in float16 it would be", "(6 bits)")),
        ("fp8_act_quant", "A3 s = amax * (1 / 448)", ("amax * (1 / 448) = ",)),
        ("fp8_act_quant", "A4 x * (1 / s)", ("x * (1 / s) = ", "encodes otherwise")),
        ("kivi_keys", "K11: multiply by the reciprocal 1 / s", ("x * (1 / s) = ", "divide")),
        ("kivi_keys", "K7: codes from the unrounded float32 scale", ("use the fp16 s",)),
        ("kivi_keys", "K3: the straddling chunk's range from its old tokens only",
         ("straddles the window", "the window's included")),
        ("kivi_keys", "K4: the window one token short", ("is in the window", "unchanged")),
        ("fp8_kv_cache", "P3: scale = amax * (1 / 448)", ("amax * (1 / 448) = ", "divide")),
        ("fp8_kv_cache", "P5: x * (1 / scale)", ("x * (1 / scale) = ", "encodes otherwise")),
        ("fp8_kv_cache", "P7: NaN beyond 448 instead of saturating",
         ("beyond the largest value", "saturates")),
        ("kv_budget", "B2: the query heads (n_heads) cached",
         ("KV heads (not the", "x 2 (K and V)")),
    ],
)
def test_feedback_shows_the_specs_intermediate_quantities(gid, mutant, words):
    msg = _feedback(gid, mutant)
    for word in words:
        assert word in msg, (word, msg)
    assert "input arg" not in msg  # the generic note is replaced by the task's explanation


def test_unmasked_load_is_named_with_the_kernel_line():
    msg = _feedback("triton_unpack_int4", "T3 masked store, unmasked load")
    assert "tl.load reads outside its tensor" in msg and "`packed_ptr`" in msg
    assert "kernel `unpack_kernel`, line" in msg and "mask=" in msg
