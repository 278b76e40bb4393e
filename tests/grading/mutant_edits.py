"""Build known-wrong implementations as textual edits of the solution cells.

Used by the mutants_<chapter>.py banks: each mutant is a solution cell with one or more
(old, new) replacements, so the bank tracks the solutions (an edit whose text is gone
fails loudly at import).
"""

from __future__ import annotations

from pathlib import Path

import nbformat

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"

Edits = dict[str, list[tuple[str, list[tuple[str, str]]]]]  # grade_id -> [(name, edits)]


def solution_sources() -> dict[str, str]:
    """grade_id -> the source of its solution cell, over every notebook in solutions/."""
    out = {}
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        for cell in nbformat.read(str(path), as_version=4).cells:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")
            if gid.endswith("_solution"):
                out[gid.removesuffix("_solution")] = cell.source
    return out


def build_mutants(
    edits: Edits, written: dict[str, list[tuple[str, str]]] | None = None
) -> dict[str, list[tuple[str, str]]]:
    """grade_id -> [(mutant name, mutated cell source), ...]: the ``written`` ones (whole
    cell sources, for bugs that are no small edit) first, then the edits."""
    sources = solution_sources()
    mutants = {gid: list(items) for gid, items in (written or {}).items()}
    for gid, variants in edits.items():
        mutants.setdefault(gid, [])
        for name, changes in variants:
            src = sources[gid]
            for old, new in changes:
                if old not in src:
                    raise AssertionError(f"mutant {gid!r} / {name!r}: {old!r} not in the solution")
                src = src.replace(old, new)
            mutants[gid].append((name, src))
    return mutants
