"""A submission's wall-clock limit: a graded function that never returns costs its task
and the tasks after it, not the grader's time.

Its own file (not test_grading_mutants.py, a module graded with a class in the background)
so that under `make test` it is handed out early, beside the chapters' background run
(tests/conftest.py EARLY): it mostly sleeps for 20 s, and CPU work overlaps the sleep.
"""

from __future__ import annotations

import time

import nbformat
from grading_bank import load, with_cells

from qlab.grading.grader import GradeOptions, grade_submission


def test_wall_clock_limit_costs_the_rest(tmp_path):
    # a function that never returns, sleeping (crash_loop_01_affine's spins: the wall clock
    # is what is tested here, and the CPU is the other tests')
    sleeper = """
def symmetric_quantize(x, bits):
    import time
    while True:
        time.sleep(1)
"""
    nb = with_cells(load("01_affine"), {"sym_quantize_solution": sleeper})
    path = tmp_path / "slow_01_affine.ipynb"
    nbformat.write(nb, str(path))
    start = time.monotonic()
    # wall 20 s: the kernel start and the cells fit (even on a busy machine), the loop does not;
    # any seed (the function never returns)
    row = grade_submission(path, "slow", GradeOptions(timeout=60, wall=20, seed=1))
    assert time.monotonic() - start < 60
    assert row.total == 0 and row.max == 5
    assert "did not finish" in row.tasks["sym_quantize"]["feedback"]
    assert "wall-clock" in row.tasks["affine_dequantize"]["feedback"]
