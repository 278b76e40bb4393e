"""`qlab grade` end to end on a class of generated submissions (real kernels).

The solutions get full marks; the untouched exercises get zero; a malformed file gets a row
of zeros; two mutant notebooks per chapter 01-07, the wrong variants below, every
tampering trick and every crashing function cost exactly their tasks' points (crashing
top-level cells cost none); and the run resumes without regrading.

grading_bank.mutant_notebooks puts the mutants of chapters 01-07 (128 today) into as many
notebooks as a chapter's largest bank (66 today; the i-th carries the i-th mutant of each
task that has one). test_grading_check.py runs every mutant through `check` (the same Task,
case generator and comparator as here) on every seed it tries, and checks that it calls
none of its task's references (unless the check crashes) and that, swapped alone into the
solution notebook, it leaves the other tasks passing (on one seed; kernel tasks are not
rerun). A notebook here costs a kernel start or more (about 3 CPU s per submission beyond a
run's fixed 12 s: the busy CPU of `qlab grade` runs of several sizes on a 2-core 2.0 GHz
Xeon), so the class grades two of them per chapter: mutant0 (every task's first mutant) and
the first notebook in which some task keeps its solution.
"""

from __future__ import annotations

import json
import re
import time

import nbformat
import pytest
from grading_bank import (
    CORE_ASSIGNMENTS,
    EXERCISES,
    MUTANTS,
    SOLUTIONS,
    ClassRun,
    grade_id,
    load,
    mutant_notebooks,
    with_cells,
)

from qlab.cli import main
from qlab.grading import all_tasks, assignment_tasks, assignments
from qlab.grading.grader import _code_cells

SEED = 20261130
# seconds per cell and task call: the solutions need at most ~2 s of CPU per task (fwht,
# measured 2.2 s; the others under 0.1 s), and the class is graded beside other tests
TIMEOUT = 12

TAMPER = {
    # redefine the check functions (and try to break the grader's code in the kernel),
    # then submit a wrong sym_quantize; asym returns objects whose __eq__ always says yes
    "tamper_checks_01_affine": (
        "01_affine",
        {
            "sym_quantize_solution": MUTANTS["sym_quantize"][0][1]
            + """
import qlab.grading
import qlab.grading.registry

def check(*args, **kwargs):
    print("PASS")
    return True

qlab.grading.check = check
qlab.grading.registry.evaluate = lambda *a, **k: None
qlab.grading.registry.compare_values = lambda *a, **k: None
""",
            "asym_quantize_solution": """
class Anything:
    def __eq__(self, other):
        return True

    def __array__(self, dtype=None, copy=None):
        import numpy
        return numpy.zeros(1)

def asymmetric_quantize(x, bits):
    return Anything(), Anything(), Anything()
""",
        },
        {},
        {"sym_quantize", "asym_quantize"},
    ),
    # edit the test cells to print PASS, swallow exceptions, hide tracebacks, and replay
    # an answer seen once
    "tamper_edits_01_affine": (
        "01_affine",
        {
            "sym_quantize": 'print("PASS sym_quantize")',
            "asym_quantize": 'print("PASS asym_quantize")',
            "sym_quantize_solution": """
get_ipython().showtraceback = lambda *a, **k: None

def symmetric_quantize(x, bits):
    try:
        raise NotImplementedError()
    except Exception:
        return torch.zeros_like(x, dtype=torch.int8), torch.tensor(1.0, dtype=torch.float16)
""",
            "asym_quantize_solution": """
import qlab

_SEEN = qlab.quantize(torch.linspace(-1, 2, 16).reshape(2, 8), qlab.int_scheme(4, False))

def asymmetric_quantize(x, bits):
    return _SEEN.codes, _SEEN.scales, _SEEN.zero_points
""",
        },
        {},
        {"sym_quantize", "asym_quantize"},
    ),
    # monkeypatch qlab and torch inside the kernel so that a grader computing references
    # there would agree with a wrong pack_int4; a tensor subclass whose == always agrees
    "tamper_patch_06_wxay": (
        "06_wxay",
        {
            "pack_int4_solution": MUTANTS["pack_int4"][0][1]
            + """
import qlab.packing
qlab.pack_int4 = pack_int4
qlab.packing.pack_int4 = pack_int4
torch.equal = lambda *a, **k: True
torch.allclose = lambda *a, **k: True
torch.testing.assert_close = lambda *a, **k: None
""",
            "w8a8_matmul_solution": """
class Agreeable(torch.Tensor):
    def __eq__(self, other):
        return torch.ones_like(other, dtype=torch.bool)

def w8a8_matmul(x, w):
    return torch.zeros(x.shape[0], w.shape[0]).as_subclass(Agreeable)
""",
        },
        {},
        {"pack_int4", "w8a8_matmul"},
    ),
    # delete every test cell; print lines that look like the grader's result channel
    "tamper_forge_02_granularity": (
        "02_granularity",
        {
            "group_quantize_solution": 'print("QLAB-" + "0" * 32 + \' {"records": []}\')\n'
            + MUTANTS["group_quantize"][0][1].replace(
                "    qmax =",
                '    print("QLAB-" + "f" * 32 + \' {"records": [{"ok": 1}]}\')\n    qmax =',
                1,
            ),
        },
        {},
        {"group_quantize"},
    ),
}

# a top-level cell that raises, run at each of crash_cells' four kernel starts: logged once,
# the terminal's escape character and a backslash escaped, whole escapes within 200
# characters (the next escape, 4 characters from character 198, is left out); then 10
# more raising cells, of which the log keeps 9 and says there were more
RAISER = "raise ValueError('\\x1b[2J\\\\' + 'a' * 176 + '\\x1b' + 'boom ' * 100)"
RAISERS = [f"raise KeyError({i})" for i in range(10)]
CRASH = {
    "crash_loop_01_affine": (
        "01_affine",
        {
            "sym_quantize_solution": """
def symmetric_quantize(x, bits):
    while True:
        pass
"""
        },
        {},
        {"sym_quantize"},
    ),
    "crash_exit_02_granularity": (
        "02_granularity",
        {
            "group_quantize_solution": """
def group_quantize(w, bits, group_size):
    import os
    os._exit(1)
"""
        },
        {},
        {"group_quantize"},
    ),
    "crash_memory_06_wxay": (
        "06_wxay",
        {
            "w8a8_matmul_solution": """
def w8a8_matmul(x, w):
    big = torch.ones(10 * 2**30, dtype=torch.uint8)  # 10 GB
    return big[: x.shape[0] * w.shape[0]].float().reshape(x.shape[0], w.shape[0])
"""
        },
        {},
        {"w8a8_matmul"},
    ),
    # top-level cells that hang, exit and segfault: skipped after a restart, tasks graded
    # (this hang sleeps, leaving the CPU to the other tests; crash_loop_01_affine's function
    # spins: with interrupt_on_timeout=False either kind ends in a killed, restarted kernel)
    "crash_cells_03_nf4": (
        "03_nf4",
        {},
        {
            "nf4_levels_solution": [RAISER, "import time\nwhile True:\n    time.sleep(1)"],
            "nf4_quantize_solution": [
                "import os\nos._exit(3)",
                "import ctypes\nctypes.string_at(0)",
                *RAISERS,
            ],
        },
        set(),
    ),
}


# Wrong student variants of chapters 12-16, graded end to end (those issue 24 found passing
# in 12-15, and chapter 16's; chapters 01-07 grade two mutant notebooks each, see
# _graded_mutants; test_grading_check.py runs every mutant through `check`, on 24 seeds,
# 3 for a kernel task): name -> (assignment, {grade_id: mutant name}).
VARIANTS = {
    "variant_halfaway_12_outliers": (
        "12_outliers",
        {"llm_int8_matmul": "I8 round half away from zero",
         "smooth_scales": "S3 returned as float64"},
    ),
    "variant_halfup_12_outliers": ("12_outliers", {"llm_int8_matmul": "I8 round half up"}),
    "variant_reciprocal_12_outliers": (
        "12_outliers",
        {"llm_int8_matmul": "I8 multiply by the reciprocal 1 / s"},
    ),
    "variant_unzeroed_12_outliers": (
        "12_outliers",
        {"llm_int8_matmul": "I6 w's outlier columns not zeroed before its scales"},
    ),
    "variant_inplace_13_gptq_awq": (
        "13_gptq_awq",
        {"gptq_hinv": "H5 h modified in place (no clone)",
         "gptq_block": "B7 codes from a float64 division"},
    ),
    "variant_gradscale_14_qat": (
        "14_qat",
        {"lsq_quantize": "L6 grad_scale argument ignored: LSQ's 1 / sqrt(N Q) instead"},
    ),
    "variant_floor_15_gguf": (
        "15_gguf",
        {"q8_0_quantize": "Q6: roundf as sign(y) * floor(|y| + 0.5)"},
    ),
    "variant_trunc_15_gguf": (
        "15_gguf",
        {"q8_0_quantize": "Q6: roundf as trunc(y + copysign(0.5, y))"},
    ),
    "variant_recip127_15_gguf": ("15_gguf", {"q8_0_quantize": "Q7: d = absmax * (1 / 127)"}),
    "variant_floor_nan_gqa_16_kv_cache": (
        "16_kv_cache",
        {"kivi_keys": "K9: floor instead of round",
         "fp8_kv_cache": "P7: NaN beyond 448 instead of saturating",
         "kv_budget": "B2: the query heads (n_heads) cached"},
    ),
}
GRADED = CORE_ASSIGNMENTS + tuple(sorted({a for a, _ in VARIANTS.values()}))


def _graded_mutants() -> dict:
    """Per chapter 01-07, two of grading_bank.mutant_notebooks: mutant0 (a mutant in every
    task) and mutant<n>, n = the smallest bank of its tasks: the first notebook in which
    a task keeps its solution, which must keep its points beside the mutants."""
    notebooks = mutant_notebooks()
    out = {}
    for a in CORE_ASSIGNMENTS:
        n = min(len(MUTANTS[g]) for g in assignments()[a])
        assert f"mutant{n}_{a}" in notebooks, f"{a}: give one task more mutants than the others"
        out.update({k: notebooks[k] for k in (f"mutant0_{a}", f"mutant{n}_{a}")})
    return out


def _all_cases():
    """Chapters 01-07 (two mutant notebooks each: _graded_mutants), and the listed variants
    of 12-16. The solutions, exercises and mutant0 notebooks of 12-16 are graded in
    test_grading_part3.py, those of the kernel chapters in
    tests/kernels/test_kernel_exercises.py."""
    cases = {}  # name -> (assignment, notebook or raw text, zero-scoring grade_ids)
    for a in CORE_ASSIGNMENTS:
        cases[f"solution_{a}"] = (a, load(a), set())
        cases[f"exercise_{a}"] = (a, load(a, EXERCISES), set(assignments()[a]))
    cases.update(_graded_mutants())
    for name, (a, picks) in VARIANTS.items():
        swap = {f"{g}_solution": dict(MUTANTS[g])[m] for g, m in picks.items()}
        cases[name] = (a, with_cells(load(a), swap), set(picks))
    for name, (a, swap, after, wrong) in {**TAMPER, **CRASH}.items():
        nb = with_cells(load(a), swap, after)
        if name == "tamper_patch_06_wxay":
            nb.cells = [c for c in nb.cells if grade_id(c) != "w8a8_matmul"]
        if name == "tamper_forge_02_granularity":
            nb.cells = [c for c in nb.cells if grade_id(c) not in assignments()[a]]
        if name == "tamper_edits_01_affine":
            for c in nb.cells:
                if grade_id(c) in ("sym_quantize", "asym_quantize"):
                    c.metadata = {}
        cases[name] = (a, nb, wrong)
    cases["malformed_04_fp8"] = ("04_fp8", "{ this is not a notebook", set(assignments()["04_fp8"]))
    cases["badschema_05_mx"] = ("05_mx", '{"cells": 5, "nbformat": 4}', set(assignments()["05_mx"]))
    return cases


CASES = _all_cases()


# graded in the background while the tests before this module run (tests/conftest.py)
CLASS_RUN = ClassRun(
    lambda: CASES,
    ["--timeout", str(TIMEOUT), "--wall", "120", "--seed", str(SEED)],
)


@pytest.fixture(scope="module")
def graded():
    return CLASS_RUN.result()


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_submission_loses_exactly_its_tasks_points(graded, name):
    assignment, _, wrong = CASES[name]
    row = graded["doc"]["submissions"][name]
    tasks = assignment_tasks(assignment)
    feedback = {g: t["feedback"] for g, t in row["tasks"].items()}
    assert set(row["tasks"]) == {t.grade_id for t in tasks}, row["log"]
    for t in tasks:
        expected = 0 if t.grade_id in wrong else t.points
        assert row["tasks"][t.grade_id]["score"] == expected, (t.grade_id, feedback, row["log"])
    assert row["max"] == sum(t.points for t in tasks)
    assert row["total"] == sum(0 if t.grade_id in wrong else t.points for t in tasks)


def test_feedback_is_precise(graded):
    subs = graded["doc"]["submissions"]
    fb = subs["mutant0_01_affine"]["tasks"]["sym_quantize"]["feedback"]
    assert "expected" in fb and "got" in fb and "codes[" in fb
    assert "did not finish" in subs["crash_loop_01_affine"]["tasks"]["sym_quantize"]["feedback"]
    assert "kernel died" in subs["crash_exit_02_granularity"]["tasks"]["group_quantize"]["feedback"]
    assert "memory" in subs["crash_memory_06_wxay"]["tasks"]["w8a8_matmul"]["feedback"]
    tamper = subs["tamper_checks_01_affine"]["tasks"]
    assert "cannot be graded" in tamper["asym_quantize"]["feedback"]
    assert "could not be read" in subs["malformed_04_fp8"]["tasks"]["e4m3_decode"]["feedback"]
    log = " ".join(subs["crash_cells_03_nf4"]["log"])
    assert "timed out" in log and "killed the kernel" in log
    code = _code_cells(CASES["crash_cells_03_nf4"][1])  # the cells the grader numbers
    said = ["ValueError: \\x1b[2J\\\\" + "a" * 176]  # 197 characters: \\x1b would pass 200
    said += [f"KeyError: {i}" for i in range(9)]
    lines = subs["crash_cells_03_nf4"]["log"]
    said_in_log = re.compile(r"notebook code cell \d+ raised |more cells")
    raised = [line for line in lines if said_in_log.match(line)]
    assert raised == [
        *(f"notebook code cell {code.index(src) + 1} raised {text}"
          for src, text in zip([RAISER, *RAISERS[:9]], said, strict=True)),
        "more cells raised errors (the first 10 above)",
    ], lines


def test_csv_has_one_row_per_submission(graded):
    rows = graded["rows"]
    assert sorted(r["submission"] for r in rows) == sorted(CASES)
    header = list(rows[0])
    assert header[:3] == ["submission", "assignment", "status"]
    assert header[-5:] == ["total", "max", "isolation", "flags", "uses_reference"]
    assert set(header[3:-5]) == {g for a in GRADED for g in assignments()[a]}
    assert all(r["uses_reference"] == "" for r in rows)  # no solution or mutant borrows
    by = {r["submission"]: r for r in rows}
    assert by["solution_06_wxay"]["total"] == by["solution_06_wxay"]["max"] == "7"
    assert by["solution_06_wxay"]["sym_quantize"] == ""  # not this assignment's task
    assert by["solution_06_wxay"]["assignment"] == "06_wxay"
    assert by["malformed_04_fp8"]["status"] == "graded"  # zero points, final
    assert {r["isolation"] for r in rows} == {graded["doc"]["isolation"]}


def test_speed(graded):
    per = graded["seconds"] / len(CASES)
    print(f"{per:.2f} s per submission with --jobs {graded['jobs']} ({len(CASES)} submissions)")
    assert per < 15


def test_resume_skips_graded_and_regrades_missing(graded):
    out = graded["out"]
    doc = json.loads((out / "grades.json").read_text())
    del doc["submissions"]["solution_02_granularity"]
    (out / "grades.json").write_text(json.dumps(doc))
    start = time.monotonic()
    assert (
        main(
            [
                "grade",
                str(graded["subs"]),
                "--out",
                str(out),
                "--jobs",
                "2",
                "--timeout",
                str(TIMEOUT),
                "--quiet",
            ]
        )
        == 0
    )
    assert time.monotonic() - start < 60  # one notebook, not the class
    again = json.loads((out / "grades.json").read_text())
    assert again["seed"] == SEED
    assert again["submissions"]["solution_02_granularity"]["total"] == 4
    for k, v in graded["doc"]["submissions"].items():
        if k != "solution_02_granularity":
            assert again["submissions"][k] == v
    assert not list(out.glob(".*.tmp"))


def test_solutions_and_registry_agree():
    for a, gids in assignments().items():
        nb = nbformat.read(str(SOLUTIONS / f"{a}.ipynb"), as_version=4)
        grade_cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]
        assert [c.metadata.nbgrader.grade_id for c in grade_cells] == gids
        for c in grade_cells:
            t = all_tasks()[c.metadata.nbgrader.grade_id]
            assert c.metadata.nbgrader.points == t.points
            assert c.source == f'check("{t.grade_id}", {t.func_name})'
