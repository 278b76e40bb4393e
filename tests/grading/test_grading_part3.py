"""Exercises 12-16 under `qlab grade`, end to end, in one class run.

test_grading_check.py runs each solution and every known-wrong implementation of these
chapters through `check` on many seeds; here real (sandboxed) kernels grade, per
assignment, the solution (full marks), the untouched exercise (zero) and the notebook
carrying the first mutant of every task (zero: each task loses its points)."""

import pytest
from grading_bank import EXERCISES, ClassRun, load, mutant_notebooks

from qlab.grading import assignment_tasks, assignments

PART3 = ("12_outliers", "13_gptq_awq", "14_qat", "15_gguf", "16_kv_cache")


def _cases():
    cases = {}
    for a in PART3:
        cases[f"solution_{a}"] = (a, load(a), set())
        cases[f"exercise_{a}"] = (a, load(a, EXERCISES), set(assignments()[a]))
        assignment, nb, wrong = mutant_notebooks((a,))[f"mutant0_{a}"]
        cases[f"mutant0_{a}"] = (assignment, nb, wrong)
    return cases


CASES = _cases()
# graded in the background while the tests before this module run (tests/conftest.py)
CLASS_RUN = ClassRun(
    lambda: CASES,
    ["--timeout", "120", "--wall", "300", "--seed", "15"],
)


@pytest.fixture(scope="module")
def graded():
    return CASES, CLASS_RUN.result()["doc"]


@pytest.mark.parametrize("assignment", PART3)
def test_each_submission_scores_what_its_code_earns(graded, assignment):
    cases, doc = graded
    for name, (a, _, wrong) in cases.items():
        if a != assignment:
            continue
        row = doc["submissions"][name]
        assert row["assignment"] == assignment, row
        for task in assignment_tasks(assignment):
            want = 0 if task.grade_id in wrong else task.points
            assert row["tasks"][task.grade_id]["score"] == want, (name, task.grade_id, row)
        assert wrong or row["total"] == row["max"] > 0, row
