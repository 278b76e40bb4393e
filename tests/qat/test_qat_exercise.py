"""Exercise 14 (solutions/14_qat.ipynb) under `qlab grade`, end to end, and exercises/ in sync.

tests/grading/test_grading_check.py already runs the solution and every known-wrong
implementation (tests/grading/mutants_ch14.py) through `check` on 6 seeds; here each mutant
meets many more seeds (tests/grading/test_grading_part3.py grades a class of them)."""

import contextlib
import io
import sys
from pathlib import Path

import nbformat
import pytest

from qlab.grading import CheckFailed, assignment_tasks, assignments, check
from qlab.grading.notebook import is_grade_cell, make_exercise

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "grading"))
import grading_bank  # noqa: E402  (merges mutants_ch14.py into MUTANTS)

ASSIGNMENT = "14_qat"
GIDS = assignments()[ASSIGNMENT]
SEEDS = range(100, 140)


def _namespace(nb) -> dict:
    ns: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and not is_grade_cell(cell):
            exec(compile(cell.source, "<cell>", "exec"), ns)
    return ns


def test_two_tasks_with_mutants_for_every_clause():
    assert GIDS == ["ste_fake_quantize", "lsq_quantize"]
    assert [len(grading_bank.MUTANTS[g]) for g in GIDS] == [6, 8]


@pytest.mark.parametrize("gid", GIDS)
def test_solution_passes_and_every_mutant_fails_on_many_seeds(gid):
    task = next(t for t in assignment_tasks(ASSIGNMENT) if t.grade_id == gid)
    solution = _namespace(grading_bank.load(ASSIGNMENT))[task.func_name]
    mutants = {name: _namespace(grading_bank.with_cells(grading_bank.load(ASSIGNMENT),
                                                         {f"{gid}_solution": src}))
               for name, src in grading_bank.MUTANTS[gid]}
    with contextlib.redirect_stdout(io.StringIO()):
        for seed in SEEDS:
            check(gid, solution, seed=seed)
            for name, ns in mutants.items():
                with pytest.raises(CheckFailed):
                    check(gid, ns[task.func_name], seed=seed)
                    pytest.fail(f"mutant {name!r} passed on seed {seed}")


def test_exercise_is_up_to_date():
    solution = nbformat.read(str(ROOT / "solutions" / f"{ASSIGNMENT}.ipynb"), as_version=4)
    wanted = nbformat.writes(make_exercise(solution, ASSIGNMENT)) + "\n"
    exercise = ROOT / "exercises" / f"{ASSIGNMENT}.ipynb"
    assert exercise.read_text(encoding="utf-8") == wanted, "run `qlab assign`"
    assert "### BEGIN SOLUTION" not in wanted and "NotImplementedError" in wanted
