"""The Triton exercises (solutions/08-10) under `qlab grade`, end to end.

The grader's own tests (tests/grading/test_grading_check.py) already run every kernel
solution and every known-wrong kernel (tests/grading/mutants_kernels.py, merged into
grading_bank.MUTANTS) through `check` in-process; here a small class of kernel
submissions is graded by real kernels, and exercises/ must match `qlab assign`."""

import json
import sys
from pathlib import Path

import nbformat
import pytest

from qlab.cli import main
from qlab.grading import all_tasks, assignment_tasks, assignments
from qlab.grading.notebook import make_exercise

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "grading"))
import grading_bank  # noqa: E402  (the grader's test helpers; merges mutants_kernels.py)

ASSIGNMENTS = ("08_triton_dequant", "09_w4a16_kernel", "10_fp8_kernel")
GIDS = [g for a in ASSIGNMENTS for g in assignments()[a]]
MUTANTS = {g: grading_bank.MUTANTS[g] for g in GIDS}


def test_every_kernel_task_has_mutants_and_runs_on_the_interpreter_when_graded():
    for assignment in ASSIGNMENTS:
        assert len(assignments()[assignment]) >= 2
    for gid in GIDS:
        assert len(MUTANTS[gid]) >= 2, gid
        assert all_tasks()[gid].kernel_env == {"TRITON_INTERPRET": "1"}


def test_qlab_grade_scores_a_class_of_kernel_submissions(tmp_path):
    # solution: full marks; untouched exercise: zero; first mutant of each task: loses it
    cases = {}
    for a in ASSIGNMENTS:
        cases[f"solution_{a}"] = (a, grading_bank.load(a), set())
        cases[f"exercise_{a}"] = (a, grading_bank.load(a, grading_bank.EXERCISES), set(GIDS))
    mutants = grading_bank.mutant_notebooks(ASSIGNMENTS)
    cases.update({k: v for k, v in mutants.items() if k.startswith("mutant0_")})
    subs = tmp_path / "subs"
    subs.mkdir()
    for name, (_, nb, _) in cases.items():
        nbformat.write(nb, str(subs / f"{name}.ipynb"))
    out = tmp_path / "out"
    argv = ["grade", str(subs), "--out", str(out), "--jobs", "2", "--timeout", "60"]
    assert main([*argv, "--wall", "180", "--seed", "7", "--quiet"]) == 0
    doc = json.loads((out / "grades.json").read_text())
    for name, (assignment, _, wrong) in cases.items():
        row = doc["submissions"][name]
        for task in assignment_tasks(assignment):
            want = 0 if task.grade_id in wrong else task.points
            assert row["tasks"][task.grade_id]["score"] == want, (name, task.grade_id, row)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_exercises_are_up_to_date(assignment):
    # What `qlab assign` writes: solutions stubbed, outputs stripped, other cells locked.
    solution = nbformat.read(str(ROOT / "solutions" / f"{assignment}.ipynb"), as_version=4)
    wanted = nbformat.writes(make_exercise(solution, assignment)) + "\n"
    exercise = ROOT / "exercises" / f"{assignment}.ipynb"
    assert exercise.read_text(encoding="utf-8") == wanted, "run `qlab assign`"
    assert "### BEGIN SOLUTION" not in wanted and "NotImplementedError" in wanted
