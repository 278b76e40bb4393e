"""Notebooks are committed clean: no outputs, no execution counts, no embedded images.

A committed output goes stale the moment qlab changes, bloats diffs, and can
hide a figure that no longer matches; the course's figures are recomputed and
asserted when the notebooks run (tests/notebooks/test_chapters.py, nbval for
solutions/), never stored.
"""

import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIRS = ("notebooks", "solutions", "exercises")
NOTEBOOKS = sorted(
    p
    for d in NOTEBOOK_DIRS
    for p in (REPO / d).rglob("*.ipynb")
    if ".ipynb_checkpoints" not in p.parts
)
# a data: URI with an image inside markdown (base64 images are forbidden in prose)
_DATA_IMAGE = re.compile(r"data:image/[a-z+]+;base64", re.IGNORECASE)


def problems(nb: nbformat.NotebookNode) -> list[str]:
    """Every reason this notebook is not clean, as 'cell N: what' strings."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            if cell.get("outputs"):
                found.append(f"cell {i}: has {len(cell.outputs)} output(s)")
            if cell.get("execution_count") is not None:
                found.append(f"cell {i}: execution_count = {cell.execution_count}")
        if cell.get("attachments"):
            found.append(f"cell {i}: has attachments")
        if cell.cell_type == "markdown" and _DATA_IMAGE.search(cell.source):
            found.append(f"cell {i}: base64 image in markdown")
    if "widgets" in nb.metadata:
        found.append("metadata: saved widget state (metadata.widgets)")
    return found


def test_there_are_notebooks():
    # the course's notebooks exist; an empty glob would make the test below vacuous
    assert any(p.parent.name == "notebooks" for p in NOTEBOOKS), "no notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(REPO)))
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    bad = problems(nb)
    assert not bad, (
        f"{path.relative_to(REPO)} is not clean:\n  "
        + "\n  ".join(bad)
        + "\nClear it with: jupyter nbconvert --clear-output --inplace "
        + str(path.relative_to(REPO))
    )


def test_checker_catches_outputs():
    # the checker itself must be able to fail
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1 + 1")
    cell.execution_count = 3
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"})]
    nb.cells = [cell, nbformat.v4.new_markdown_cell("![x](data:image/png;base64,iVBOR)")]
    assert len(problems(nb)) == 3
    assert problems(nbformat.v4.new_notebook()) == []
