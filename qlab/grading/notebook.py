"""Notebook plumbing shared by ``qlab assign`` and ``qlab grade``.

Cells follow nbgrader's v3 metadata (``metadata.nbgrader``):
- solution cell: ``solution: true``; the code between ``### BEGIN SOLUTION`` and
  ``### END SOLUTION`` is the answer, replaced by a stub in exercises/;
- grade (check) cell: ``grade: true, solution: false, locked: true, points: N``; its
  ``grade_id`` is the task's id in the registry;
- everything else: ``locked: true`` (read-only in exercises/).
"""

from __future__ import annotations

import copy
from pathlib import Path

from qlab.grading._nbformat import nbformat

__all__ = [
    "BEGIN",
    "END",
    "STUB",
    "is_grade_cell",
    "is_solution_cell",
    "make_exercise",
    "assign_dir",
    "read_notebook",
    "assignment_of",
]

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = "# YOUR CODE HERE\nraise NotImplementedError()"


def _nbg(cell) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def is_grade_cell(cell) -> bool:
    """A check cell: an nbgrader grade cell that is not also a solution cell.

    The grader never runs these (it runs its own checks), whatever their source says.
    A cell stripped of this metadata runs like any other cell, and its check() call is
    a no-op in the grading kernel.
    """
    if cell.get("cell_type") != "code":
        return False
    meta = _nbg(cell)
    return meta.get("grade") is True and meta.get("solution") is not True


def is_solution_cell(cell) -> bool:
    return cell.get("cell_type") == "code" and _nbg(cell).get("solution") is True


def _stub_solution(source: str) -> str:
    """Replace each BEGIN/END SOLUTION region by STUB, at the BEGIN line's indentation."""
    out, inside = [], False
    for line in source.splitlines():
        if line.strip() == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(indent + s for s in STUB.splitlines())
        elif line.strip() == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "\n".join(out)


def make_exercise(nb: nbformat.NotebookNode, assignment: str) -> nbformat.NotebookNode:
    """The learner's copy: solutions stubbed, outputs stripped, every non-answer cell locked."""
    nb = copy.deepcopy(nb)
    nb.metadata["qlab"] = {"assignment": assignment}
    for cell in nb.cells:
        meta = cell.setdefault("metadata", {})
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        if is_solution_cell(cell):
            if BEGIN not in cell.source:
                raise ValueError(f"solution cell {_nbg(cell).get('grade_id')!r} has no {BEGIN}")
            cell.source = _stub_solution(cell.source)
            meta.pop("editable", None)
            meta.pop("deletable", None)
        else:
            meta["editable"] = False
            meta["deletable"] = False
            if "nbgrader" in meta:
                meta["nbgrader"]["locked"] = True
        meta.pop("execution", None)
    return nb


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def _named_in(text: str, known: list[str]) -> list[str]:
    """Known assignment names that occur in ``text``, minus those inside a longer match."""
    hits = [n for n in known if n in text]
    return [n for n in hits if not any(n != m and n in m for m in hits)]


def assignment_of(
    nb: nbformat.NotebookNode | None, path: Path, known: list[str], forced: str | None = None
) -> tuple[str | None, list[str]]:
    """Which assignment a submission is graded as, and flags where the sources disagree.

    Sources, in order: ``forced`` (the instructor's ``--assignment``); the file name (its
    stem, else its folder's name), which the instructor's collection controls; the
    notebook metadata that ``qlab assign`` writes (``metadata.qlab.assignment``), which
    travels with a copied notebook. The first that names exactly one assignment wins; a
    later source that names a different one is flagged (``name_mismatch: ...``), never
    silently ignored.
    """
    meta = nb.get("metadata", {}).get("qlab", {}) if nb is not None else {}
    meta_name = meta.get("assignment") if isinstance(meta, dict) else None
    by_meta = meta_name if isinstance(meta_name, str) and meta_name in known else None
    by_name = None
    for part in (path.stem, path.parent.name):
        hits = _named_in(part, known)
        if len(hits) == 1:
            by_name = hits[0]
            break
    flags = []
    sources = [("--assignment", forced), ("file name", by_name), ("notebook metadata", by_meta)]
    chosen = next(((src, n) for src, n in sources if n is not None), None)
    if chosen is None:
        return None, flags
    for src, n in sources:
        if n is not None and n != chosen[1]:
            flags.append(
                f"name_mismatch: the {src} says {n}, the {chosen[0]} says {chosen[1]}; "
                f"graded as {chosen[1]} (the {chosen[0]})"
            )
    if isinstance(meta_name, str) and meta_name and by_meta is None:
        flags.append(f"unknown_assignment: the notebook metadata names {meta_name[:80]!r}")
    return chosen[1], flags


def assign_dir(source: Path, dest: Path, check: bool = False) -> list[str]:
    """Generate dest/*.ipynb from source/*.ipynb. Returns the drifted/written file names.

    With check=True nothing is written: the names of the files that would change
    (missing, different, or extra in dest) are returned.
    """
    changed = []
    wanted = {}
    for src in sorted(Path(source).glob("*.ipynb")):
        nb = read_notebook(src)
        text = nbformat.writes(make_exercise(nb, src.stem)) + "\n"
        wanted[src.name] = text
        target = Path(dest) / src.name
        old = target.read_text(encoding="utf-8") if target.exists() else None
        if old != text:
            changed.append(src.name)
            if not check:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
    if Path(dest).exists():
        for extra in sorted(Path(dest).glob("*.ipynb")):
            if extra.name not in wanted:
                changed.append(f"{extra.name} (no solution notebook)")
    return changed
