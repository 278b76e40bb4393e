"""Known-wrong implementations and submission builders for the grader's tests.

MUTANTS[grade_id] = [(name, cell source), ...]: each replaces that task's solution cell
and must cost exactly that task's points (and fail `check` on every seed). Every chapter
keeps its bank in ``tests/grading/mutants_<chapter>.py`` (a module with a ``MUTANTS`` dict
of that form, one mutant per spec clause of its tasks); they are merged in below.
Submissions are built from solutions/ by swapping cell sources, so they track the
solution notebooks automatically.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"

# grade_id -> [(name, cell source), ...], merged below from every mutants_<chapter>.py
MUTANTS: dict[str, list[tuple[str, str]]] = {}


CORE_ASSIGNMENTS = (
    "01_affine", "02_granularity", "03_nf4", "04_fp8", "05_mx", "06_wxay", "07_quality",
)


def _merge_chapter_banks() -> None:
    for path in sorted(Path(__file__).parent.glob("mutants_*.py")):
        module = importlib.import_module(path.stem)
        for gid, items in module.MUTANTS.items():
            MUTANTS.setdefault(gid, []).extend(items)


_merge_chapter_banks()


def load(name: str, folder: Path = SOLUTIONS) -> nbformat.NotebookNode:
    return nbformat.read(str(folder / f"{name}.ipynb"), as_version=4)


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def with_cells(
    nb, replace: dict[str, str] | None = None, after: dict[str, list[str]] | None = None
) -> nbformat.NotebookNode:
    """Copy of nb: cell sources replaced by grade_id; new plain cells inserted after one."""
    nb = copy.deepcopy(nb)
    replace, after = dict(replace or {}), dict(after or {})
    cells = []
    for cell in nb.cells:
        gid = grade_id(cell)
        if gid in replace:
            cell.source = replace.pop(gid).strip("\n")
        cells.append(cell)
        for src in after.pop(gid, []):
            cells.append(nbformat.v4.new_code_cell(src.strip("\n")))
    assert not replace and not after, f"unknown grade_ids: {list(replace) + list(after)}"
    nb.cells = cells
    return nb


def mutant_notebooks(
    names: tuple[str, ...] = CORE_ASSIGNMENTS,
) -> dict[str, tuple[str, nbformat.NotebookNode, set[str]]]:
    """name -> (assignment, notebook, grade_ids that must score 0). The i-th notebook of an
    assignment carries the i-th mutant of each of its tasks (so few kernels are needed)."""
    from qlab.grading import assignments

    out = {}
    for assignment in names:
        gids = assignments()[assignment]
        nb = load(assignment)
        depth = max(len(MUTANTS.get(g, [])) for g in gids)
        for i in range(depth):
            swap = {f"{g}_solution": MUTANTS[g][i][1] for g in gids if i < len(MUTANTS.get(g, []))}
            wrong = {g for g in gids if i < len(MUTANTS.get(g, []))}
            out[f"mutant{i}_{assignment}"] = (assignment, with_cells(nb, swap), wrong)
    return out
