"""Rebuild ``corpus.txt`` from the docstrings of a CPython standard library.

The shipped corpus was built once, with::

    python qlab/lm/data/build_corpus.py /usr/lib/python3.11 qlab/lm/data/corpus.txt

It is NOT run at training time (training reads the shipped file, so every machine
trains on the same bytes); it is kept so the provenance of the text is checkable.

Rules: every ``*.py`` file under the stdlib root, sorted by path, skipping tests,
``site-packages``/``dist-packages``, ``idlelib``, ``lib2to3`` and the build config; module,
class and function docstrings in source order, dedented with ``inspect.cleandoc``;
doctest lines (``>>>``/``...``) dropped; docstrings shorter than 80 characters or
containing non-ASCII characters dropped; duplicates dropped; stop at ``MAX_BYTES``.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

MAX_BYTES = 1_000_000  # ~1 MB of text: enough for a ~2 M parameter byte-level model
MIN_CHARS = 80
SKIP_PARTS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3",
              "__pycache__", "ensurepip", "turtledemo"}


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append(doc)
    return out


def clean(doc: str) -> str | None:
    text = inspect.cleandoc(doc)
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith((">>>", "..."))]
    text = "\n".join(lines).strip()
    if len(text) < MIN_CHARS or not text.isascii():
        return None
    return text


def main(root: str, out: str) -> None:
    seen: set[str] = set()
    chunks: list[str] = []
    total = 0
    for path in sorted(Path(root).rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        for doc in docstrings(path):
            text = clean(doc)
            if text is None or text in seen:
                continue
            seen.add(text)
            chunks.append(text + "\n\n")
            total += len(chunks[-1])
            if total >= MAX_BYTES:
                break
        if total >= MAX_BYTES:
            break
    Path(out).write_text("".join(chunks), encoding="ascii")
    print(f"wrote {total} bytes, {len(chunks)} docstrings to {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
