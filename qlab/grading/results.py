"""``qlab grade``'s results: one row per submission, written atomically, resumed, merged.

``OUT/grades.json`` = ``{"seed", "isolation", "shard", "submissions": {key: row}}`` and
``OUT/grades.csv`` (one line per row: submission, assignment, status, one column per
task, total, max, isolation, flags, uses_reference: the tasks whose function called a
reference). A text cell that a spreadsheet would read as a formula (it begins with
``=``, ``+``, ``-``, ``@``, a tab or a carriage return) is written with a leading ``'``.
Both are rewritten (temp file + ``os.replace``)
after every submission, so an interrupted run loses nothing and a rerun resumes: a row
whose status is final and whose file is unchanged (same SHA-256) is not graded again.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

__all__ = [
    "SubmissionRow",
    "GRADED",
    "ERROR",
    "WORKER_DIED",
    "FINAL",
    "sha256_of",
    "load_results",
    "write_results",
    "needs_grading",
    "merge_results",
]

GRADED = "graded"  # every task has a score (the notebook may still have crashed: see log)
WORKER_DIED = "worker_died"  # the grader process grading it died: 0 points, not retried
ERROR = "error"  # the grader could not grade it (e.g. no kernel started): retried on rerun
FINAL = (GRADED, WORKER_DIED)


@dataclass
class SubmissionRow:
    """One submission's result: a row of grades.csv and an entry of grades.json."""

    submission: str  # key: file stem, or folder/stem when two folders hold that stem
    path: str
    sha256: str = ""
    assignment: str | None = None
    seed: int = 0
    status: str = ERROR
    isolation: str = ""
    tasks: dict[str, dict] = field(default_factory=dict)  # grade_id -> TaskResult fields
    total: int = 0
    max: int = 0
    flags: list[str] = field(default_factory=list)  # e.g. file name vs metadata mismatch
    log: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> SubmissionRow:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def sha256_of(path: Path) -> str:
    """The file's SHA-256; a symbolic link's is that of its target's NAME (never followed)."""
    try:
        if Path(path).is_symlink():
            return hashlib.sha256(b"symlink:" + os.fsencode(os.readlink(path))).hexdigest()
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def load_results(out: Path) -> tuple[dict, dict[str, SubmissionRow]]:
    """(header fields of OUT/grades.json, rows); empty when there is none or it is unreadable."""
    try:
        doc = json.loads((Path(out) / "grades.json").read_text(encoding="utf-8"))
        subs = doc.pop("submissions")
        return doc, {k: SubmissionRow.from_dict(v) for k, v in subs.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}, {}


def needs_grading(row: SubmissionRow | None, sha256: str, assignment: str | None) -> bool:
    """A rerun grades a submission again unless its row is final for this very file."""
    if row is None or row.status not in FINAL or row.sha256 != sha256:
        return True
    return assignment is not None and row.assignment != assignment


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8", errors="backslashreplace")  # any file name
    os.replace(tmp, path)


def cell(value):
    """A CSV cell no spreadsheet runs as a formula (OWASP's CSV injection advice)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _csv(rows: dict[str, SubmissionRow], task_order: list[str]) -> str:
    used = {g for r in rows.values() for g in r.tasks}
    cols = [g for g in task_order if g in used] + sorted(used - set(task_order))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    head = ["submission", "assignment", "status", *cols, "total", "max", "isolation", "flags"]
    w.writerow([*head, "uses_reference"])
    for key in sorted(rows):
        r = rows[key]
        scores = [r.tasks[g]["score"] if g in r.tasks else "" for g in cols]
        flags = "; ".join(f.split(":", 1)[0] for f in r.flags)  # the codes; details in JSON
        borrowed = " ".join(g for g in cols if r.tasks.get(g, {}).get("uses_reference"))
        line = [key, r.assignment or "", r.status, *scores, r.total, r.max, r.isolation, flags]
        w.writerow([cell(v) for v in [*line, borrowed]])
    return buf.getvalue()


def write_results(
    out: Path, rows: dict[str, SubmissionRow], header: dict, task_order: list[str]
) -> None:
    """Rewrite OUT/grades.json and OUT/grades.csv atomically (header: seed, isolation...)."""
    out = Path(out)
    doc = {**header, "submissions": {k: asdict(rows[k]) for k in sorted(rows)}}
    _atomic_write(out / "grades.json", json.dumps(doc, indent=1) + "\n")
    _atomic_write(out / "grades.csv", _csv(rows, task_order))


def merge_results(folders: list[Path], out: Path, task_order: list[str]) -> dict:
    """Combine the grades.json of shards (found under each folder) into OUT/grades.*.

    Every shard of one run must be there (``shard`` = "I/N" for I = 1..N, once each) and
    use the same seed; a submission graded in two shards must have the same row in both.
    Returns the merged header and the number of rows; raises ValueError otherwise.
    """
    out = Path(out).resolve()
    found = sorted(
        {p.resolve() for f in folders for p in Path(f).rglob("grades.json")} - {out / "grades.json"}
    )
    if not found:
        raise ValueError(f"no grades.json under {', '.join(map(str, folders))}")
    headers, rows = [], {}
    for path in found:
        header, part = load_results(path.parent)
        if not header:
            raise ValueError(f"{path} is not a grades.json written by qlab grade")
        headers.append((path, header))
        for k, row in part.items():
            if k in rows and asdict(rows[k]) != asdict(row):
                raise ValueError(f"{k} has different results in two shards (e.g. {path})")
            rows[k] = row
    _check_shards(headers)
    seeds = {h.get("seed") for _, h in headers}
    isolation = sorted({h.get("isolation") or "" for _, h in headers})
    merged = {"seed": seeds.pop(), "isolation": "+".join(isolation), "shard": None}
    merged["merged_from"] = [str(p) for p, _ in headers]
    out.mkdir(parents=True, exist_ok=True)
    write_results(out, rows, merged, task_order)
    return {**merged, "rows": len(rows)}


def _check_shards(headers: list[tuple[Path, dict]]) -> None:
    if len({h.get("seed") for _, h in headers}) != 1:
        seeds = ", ".join(f"{p}: {h.get('seed')}" for p, h in headers)
        raise ValueError(f"the shards used different seeds ({seeds}); grade with one --seed")
    specs = [h.get("shard") for _, h in headers]
    if specs == [None]:
        return  # one unsharded result: nothing to check
    if None in specs or len({s.split("/")[1] for s in specs}) != 1:
        raise ValueError(f"mixed shard counts or unsharded results: {specs}")
    n = int(specs[0].split("/")[1])
    missing = sorted(set(range(1, n + 1)) - {int(s.split("/")[0]) for s in specs})
    if missing or len(specs) != n:
        raise ValueError(f"shards {missing or specs} of {n} are missing or duplicated")
