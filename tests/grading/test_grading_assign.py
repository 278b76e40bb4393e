"""`qlab assign`: exercises/ is generated from solutions/ and must not drift."""

from __future__ import annotations

import shutil

import nbformat
import pytest
from grading_bank import EXERCISES, SOLUTIONS

from qlab.cli import main
from qlab.grading.notebook import BEGIN, END, assign_dir, is_grade_cell, make_exercise


def test_exercises_match_solutions(capsys):
    """Fails when solutions/ changed and `qlab assign` was not re-run (or exercises/ was edited)."""
    assert assign_dir(SOLUTIONS, EXERCISES, check=True) == [], (
        "exercises/ drifted from solutions/: run `qlab assign`"
    )
    assert main(["assign", "--source", str(SOLUTIONS), "--dest", str(EXERCISES), "--check"]) == 0


def test_drift_is_detected(tmp_path, capsys):
    dest = tmp_path / "exercises"
    shutil.copytree(EXERCISES, dest)
    nb_path = sorted(dest.glob("*.ipynb"))[0]
    nb = nbformat.read(str(nb_path), as_version=4)
    nb.cells[0].source += "\nedited by hand"
    nbformat.write(nb, str(nb_path))
    (dest / "99_stray.ipynb").write_text((dest / nb_path.name).read_text())
    assert main(["assign", "--source", str(SOLUTIONS), "--dest", str(dest), "--check"]) == 1
    err = capsys.readouterr().err
    assert nb_path.name in err and "99_stray" in err
    assert main(["assign", "--source", str(SOLUTIONS), "--dest", str(dest)]) == 0
    assert assign_dir(SOLUTIONS, dest, check=True) == ["99_stray.ipynb (no solution notebook)"]


@pytest.mark.parametrize("path", sorted(EXERCISES.glob("*.ipynb")), ids=lambda p: p.stem)
def test_exercise_is_stubbed_stripped_and_locked(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["qlab"]["assignment"] == path.stem
    n_solution = n_grade = 0
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        assert meta.get("schema_version") == 3
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
        if meta.get("solution"):
            n_solution += 1
            assert BEGIN not in cell.source and END not in cell.source
            assert "raise NotImplementedError()" in cell.source
            assert "def " in cell.source  # the signature and docstring stay
            assert cell.metadata.get("editable", True) is not False
        else:
            assert meta.get("locked") is True
            assert cell.metadata.get("editable") is False
            assert cell.metadata.get("deletable") is False
        if is_grade_cell(cell):
            n_grade += 1
            assert meta.get("points", 0) > 0 and "check(" in cell.source
    assert n_solution == n_grade >= 2


@pytest.mark.parametrize("path", sorted(SOLUTIONS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_solution_notebook_shape(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells]
    assert len(ids) == len(set(ids)), "nbgrader grade_ids must be unique"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], "solutions are committed without outputs"
        if cell.metadata["nbgrader"]["solution"]:
            assert cell.source.count(BEGIN) == 1 and cell.source.count(END) == 1


def test_stub_keeps_indentation_and_code_outside_regions():
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                'TABLE = 1\n\ndef f(x):\n    """doc"""\n    ### BEGIN SOLUTION\n    return x\n'
                "    ### END SOLUTION\n",
                metadata={
                    "nbgrader": {
                        "solution": True,
                        "grade": False,
                        "grade_id": "f",
                        "locked": False,
                        "schema_version": 3,
                    }
                },
            )
        ]
    )
    out = make_exercise(nb, "demo").cells[0].source
    assert out == (
        'TABLE = 1\n\ndef f(x):\n    """doc"""\n    # YOUR CODE HERE\n'
        "    raise NotImplementedError()"
    )
    bad = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                "### BEGIN SOLUTION\nx = 1\n", metadata={"nbgrader": {"solution": True}}
            )
        ]
    )
    with pytest.raises(ValueError, match="without"):
        make_exercise(bad, "demo")
