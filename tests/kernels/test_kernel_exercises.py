"""The Triton exercises (solutions/08-10) under `qlab grade`, end to end, and the
interpreter's out-of-bounds checker they are graded under (qlab/grading/tasks/_bounds.py).

The grader's own tests (tests/grading/test_grading_check.py) already run every kernel
solution and every known-wrong kernel (tests/grading/mutants_kernels.py, merged into
grading_bank.MUTANTS) through `check`; here a small class of kernel submissions is graded
by real kernels, and exercises/ must match `qlab assign`."""

import sys
from pathlib import Path

import pytest
import torch

import qlab.kernels  # noqa: F401  (picks the CPU interpreter when there is no GPU)
from qlab.grading import all_tasks, assignment_tasks, assignments
from qlab.grading.tasks._bounds import OutOfBounds, checking

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "grading"))
import grading_bank  # noqa: E402  (the grader's test helpers; merges mutants_kernels.py)
from mutant_edits import solution_sources  # noqa: E402

ASSIGNMENTS = ("08_triton_dequant", "09_w4a16_kernel", "10_fp8_kernel")
UNMASKED = [
    ("triton_unpack_int4", "T3 masked store, unmasked load"),
    ("triton_dequant", "D4 masked store, unmasked scale load"),
    ("w4a16_gemv", "W4 weight rows past N loaded unmasked"),
    ("fp8_act_quant", "A2 masked stores, unmasked loads"),
]
GIDS = [g for a in ASSIGNMENTS for g in assignments()[a]]
MUTANTS = {g: grading_bank.MUTANTS[g] for g in GIDS}


def test_every_kernel_task_has_mutants_and_runs_on_the_interpreter_when_graded():
    for assignment in ASSIGNMENTS:
        assert len(assignments()[assignment]) >= 2
    for gid in GIDS:
        assert len(MUTANTS[gid]) >= 2, gid
        assert all_tasks()[gid].kernel_env == {"TRITON_INTERPRET": "1"}


def _class() -> grading_bank.Cases:
    # solution: full marks; untouched exercise: zero; first mutant of each task: loses it
    cases = {}
    for a in ASSIGNMENTS:
        cases[f"solution_{a}"] = (a, grading_bank.load(a), set())
        cases[f"exercise_{a}"] = (a, grading_bank.load(a, grading_bank.EXERCISES), set(GIDS))
    mutants = grading_bank.mutant_notebooks(ASSIGNMENTS)
    cases.update({k: v for k, v in mutants.items() if k.startswith("mutant0_")})
    # loads (and a store) outside their tensors: the right result, caught by the bounds check
    for a in ASSIGNMENTS:  # one notebook per assignment, all its unmasked mutants in it
        swap = {f"{g}_solution": _mutant(g, n) for g, n in UNMASKED if g in assignments()[a]}
        wrong = {k.removesuffix("_solution") for k in swap}
        cases[f"unmasked_{a}"] = (a, grading_bank.with_cells(grading_bank.load(a), swap), wrong)
    return cases


# graded in the background while the tests before this module run (tests/conftest.py)
CLASS_RUN = grading_bank.ClassRun(
    _class, ["--timeout", "60", "--wall", "180", "--seed", "7"]
)


@pytest.fixture(scope="module")
def graded():
    return CLASS_RUN.result()["doc"]


def test_qlab_grade_scores_a_class_of_kernel_submissions(graded):
    cases, doc = _class(), graded
    for name, (assignment, _, wrong) in cases.items():
        row = doc["submissions"][name]
        for task in assignment_tasks(assignment):
            want = 0 if task.grade_id in wrong else task.points
            assert row["tasks"][task.grade_id]["score"] == want, (name, task.grade_id, row)


def _mutant(gid: str, name: str) -> str:
    return dict(grading_bank.MUTANTS[gid])[name]


# ---- the out-of-bounds checker on the interpreter ------------------------------------------


def _unpack(source: str, name: str = "unpack_int4_triton"):
    ns = {"DEVICE": qlab.kernels.DEVICE}
    head = "import torch, triton\nimport triton.language as tl\n"
    exec(compile(head + source, "<exercise 08>", "exec"), ns)
    return ns[name]


def test_bounds_checker_passes_a_masked_kernel():
    fn = _unpack(solution_sources()["triton_unpack_int4"])
    packed = torch.randint(0, 256, (3, 37), dtype=torch.uint8)
    with checking():
        out = fn(packed)
    assert torch.equal(out, qlab.unpack_int4(packed, signed=True))


def test_bounds_checker_catches_an_unmasked_load_with_a_right_result():
    fn = _unpack(_mutant("triton_unpack_int4", "T3 masked store, unmasked load"))
    packed = torch.randint(0, 256, (3, 37), dtype=torch.uint8)
    # without the check the result is right: the stray lanes are never stored
    assert torch.equal(fn(packed), qlab.unpack_int4(packed, signed=True))
    with checking(), pytest.raises(OutOfBounds) as err:
        fn(packed)
    msg = str(err.value)
    assert "tl.load reads outside its tensor" in msg and "`packed_ptr`" in msg
    assert "kernel `unpack_kernel`, line" in msg and "past its end" in msg


def test_bounds_checker_stops_an_unmasked_store_before_it_writes():
    kernel = _unpack(_mutant("triton_unpack_int4", "T3 unmasked store"), "unpack_kernel")
    packed = torch.randint(0, 256, (3, 37), dtype=torch.uint8)
    arena = torch.full((3 * 74 + 4096,), 7, dtype=torch.int8)
    codes = arena[: 3 * 74].view(3, 74)  # the output, with memory of ours behind it
    with checking(), pytest.raises(OutOfBounds, match="tl.store writes outside"):
        kernel[(1, 2)](packed, codes, 3, 37, BLOCK_R=16, BLOCK_K=64)
    assert bool((arena == 7).all())  # raised before the first store: nothing written


def test_bounds_checker_flags_a_load_that_strays_into_another_tensor():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs), mask=offs < n)  # reads BLOCK elements

    buf = torch.arange(64, dtype=torch.float32)
    src, dst = buf[:8], torch.empty(8)  # src's stray lanes land in buf's other elements
    with checking(), pytest.raises(OutOfBounds, match="`src`"):
        copy[(1,)](src, dst, 8, BLOCK=16)
    with checking():
        copy[(1,)](buf[:16], dst.new_empty(16), 16, BLOCK=16)  # exactly in bounds: fine
