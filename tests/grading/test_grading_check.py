"""Learner-side check() and the comparators: solutions pass, every mutant fails, in-process."""

from __future__ import annotations

import math

import pytest
import torch
from grading_bank import MUTANTS, SOLUTIONS, grade_id, load, with_cells

from qlab.grading import CheckFailed, all_tasks, assignments, check
from qlab.grading import _harness as wire
from qlab.grading.notebook import is_grade_cell
from qlab.grading.registry import compare_values, evaluate, make_cases

SEEDS = (1, 2, 3, 4, 5, 6)


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
    for seed in SEEDS:
        assert check(gid, ns[task.func_name], seed=seed) is True
    assert "PASS" in capsys.readouterr().out


MUTANT_IDS = [(g, i) for g in sorted(MUTANTS) for i in range(len(MUTANTS[g]))]


@pytest.mark.parametrize("gid,i", MUTANT_IDS, ids=[f"{g}-{i}" for g, i in MUTANT_IDS])
def test_mutant_fails_on_every_seed(gid, i, capsys):
    name, source = MUTANTS[gid][i]
    task = all_tasks()[gid]
    ns = _namespace(with_cells(load(task.assignment), {f"{gid}_solution": source}))
    for seed in SEEDS:
        with pytest.raises(CheckFailed):
            check(gid, ns[task.func_name], seed=seed)
    out = capsys.readouterr().out
    assert out.count("FAIL") == len(SEEDS), name
    assert "expected" in out or "raised" in out


def test_every_task_has_mutants_and_a_solution_notebook():
    """Every registered task needs a solution notebook and >= 2 known-wrong implementations
    (in grading_bank.MUTANTS or a tests/grading/mutants_<chapter>.py module)."""
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
    assert compare_values(torch.tensor([1, 2], dtype=torch.int8), torch.tensor([1, 2])) is None
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
