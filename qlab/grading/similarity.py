"""``similarity.csv``: pairs of submissions whose answers are near-identical, for a person to read.

For each submission its solution cells (nbgrader ``solution: true``; every code cell that
is not a check cell when that metadata is gone) are reduced to a stream of tokens in which
comments, docstrings, blank lines and layout are gone and every name that is not a
keyword, an attribute (``torch.round`` stays) or a builtin is the same placeholder, so
renaming variables or reformatting changes nothing. The template is left out: a
normalised line that occurs in the handed-out exercise (``exercises/<assignment>.ipynb``
of the checkout qlab is installed from, or ``template_dir``: signatures, imports, the
stub) is not an answer; without one only comments and docstrings are left out (the CSV's
``template`` column says which). Two submissions of one assignment are reported when the
Jaccard similarity of their sets of ``K``-token shingles is at least ``THRESHOLD`` and
each has at least ``MIN_TOKENS`` tokens of its own. A score is evidence to look at, not
a verdict: short exercises have few ways to be written.
"""

from __future__ import annotations

import builtins
import csv
import io
import keyword
import tokenize
from itertools import combinations
from pathlib import Path

from qlab.grading.notebook import assignment_of, is_grade_cell, is_solution_cell, read_notebook
from qlab.grading.results import cell

__all__ = ["normalise", "pairs", "write_similarity", "K", "THRESHOLD", "MIN_TOKENS"]

K = 5  # tokens per shingle
THRESHOLD = 0.8  # Jaccard similarity reported
MIN_TOKENS = 20  # tokens of a submission's own code (template left out) to be compared
EXERCISES = Path(__file__).resolve().parents[2] / "exercises"  # in a checkout of the course
_KEEP = set(keyword.kwlist) | set(dir(builtins))
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def normalise(source: str) -> list[tuple[str, ...]]:
    """One tuple of tokens per logical line; names -> "v", strings -> "s", docstrings,
    comments and layout dropped. Unparsable code falls back to whitespace-split lines."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [tuple(line.split()) for line in source.splitlines() if line.split()]
    lines, line, prev = [], [], None
    for tok in tokens:
        if tok.type in _SKIP:
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if line and not (len(line) == 1 and line[0] == "s"):  # a lone string: a docstring
                lines.append(tuple(line))
            line = []
        elif tok.type == tokenize.NAME:
            keep = tok.string in _KEEP or (prev is not None and prev.string == ".")
            line.append(tok.string if keep else "v")
        elif tok.type == tokenize.STRING:
            line.append("s")
        else:
            line.append(tok.string)
        prev = tok
    return lines


def _answer(path: Path):
    """(notebook, its solution cells' code), or None for a link or an unreadable file."""
    if path.is_symlink():
        return None
    try:
        nb = read_notebook(path)
        cells = [c for c in nb.cells if isinstance(c, dict)]
    except Exception:  # noqa: BLE001 - an unreadable notebook has nothing to compare
        return None
    code = [c for c in cells if c.get("cell_type") == "code" and isinstance(c.get("source"), str)]
    chosen = [c for c in code if is_solution_cell(c)] or [c for c in code if not is_grade_cell(c)]
    return nb, "\n".join(c["source"] for c in chosen)


def _shingles(lines: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
    stream = [t for line in lines for t in (*line, "\n")]
    return {tuple(stream[i : i + K]) for i in range(max(0, len(stream) - K + 1))}


def pairs(
    answers: dict[str, list[tuple[str, ...]]], template: set[tuple[str, ...]] = frozenset()
) -> list[tuple[str, str, float]]:
    """(a, b, score) for every pair of one assignment's normalised answers above THRESHOLD,
    lines of the ``template`` left out."""
    own = {k: [line for line in v if line not in template] for k, v in answers.items()}
    sets = {
        k: _shingles(v) for k, v in own.items() if sum(len(line) for line in v) >= MIN_TOKENS
    }
    found = []
    for a, b in combinations(sorted(sets), 2):
        union = len(sets[a] | sets[b])
        score = len(sets[a] & sets[b]) / union if union else 0.0
        if score >= THRESHOLD:
            found.append((a, b, round(score, 3)))
    return sorted(found, key=lambda p: (-p[2], p[0], p[1]))


def _template(name: str, folder: Path) -> set[tuple[str, ...]] | None:
    found = _answer(folder / f"{name}.ipynb")
    return set(normalise(found[1])) if found is not None else None


def write_similarity(
    out: Path,
    submissions: dict[str, Path],
    known: list[str],
    forced: str | None = None,
    template_dir: Path = EXERCISES,
    decided: dict[str, str] | None = None,
) -> int:
    """Write OUT/similarity.csv (assignment, submission_a, submission_b, similarity,
    template); returns the number of pairs. ``decided``: key -> the assignment a
    submission was graded as (``qlab grade merge``), instead of reading it again."""
    by_assignment: dict[str, dict[str, list[tuple[str, ...]]]] = {}
    for key, path in submissions.items():
        found = _answer(path)
        if found is None:
            continue
        nb, source = found
        name = (decided or {}).get(key) or assignment_of(nb, path, known, forced)[0]
        if name is not None:
            by_assignment.setdefault(name, {})[key] = normalise(source)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["assignment", "submission_a", "submission_b", "similarity", "template"])
    n = 0
    for name in sorted(by_assignment):
        template = _template(name, Path(template_dir))
        used = "exercise" if template is not None else "none found"
        for a, b, score in pairs(by_assignment[name], template or set()):
            w.writerow([cell(name), cell(a), cell(b), score, used])
            n += 1
    tmp = Path(out) / ".similarity.csv.tmp"
    tmp.write_text(buf.getvalue(), encoding="utf-8", errors="backslashreplace")
    tmp.replace(Path(out) / "similarity.csv")
    return n
