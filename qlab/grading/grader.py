"""``qlab grade``: grade a folder of submitted notebooks; never trust the notebook.

For each submission (in a worker process, ``--jobs`` in parallel: :mod:`.pool`):
1. read it and decide which assignment it is (file name, else metadata; a disagreement
   is flagged in the row: :func:`qlab.grading.notebook.assignment_of`);
2. draw each task's inputs here, seeded by (run seed, submission, task);
3. run its code cells in a fresh kernel, sandboxed with bwrap where that works
   (:mod:`.sandbox`), then call each task's function with those inputs and compare the
   plain data that comes back with qlab in this process (:mod:`.session`);
4. write grades.json and grades.csv atomically (:mod:`.results`); a rerun resumes;
5. flag byte-identical files (``duplicate``) and links (``symlink``: never followed), and
   write similarity.csv: near-identical answers across the class (:mod:`.similarity`).
``--shard I/N`` grades one deterministic slice of the submissions (by a hash of each
submission's key) into OUT/shard-I-of-N/; :func:`merge` combines the slices.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from qlab.grading import results, sandbox
from qlab.grading._nbformat import nbformat
from qlab.grading.notebook import assignment_of, is_grade_cell, read_notebook
from qlab.grading.pool import run_pool
from qlab.grading.registry import (
    TaskResult,
    all_tasks,
    assignment_tasks,
    assignments,
    case_seed,
    make_cases,
)
from qlab.grading.results import SubmissionRow
from qlab.grading.session import GradeOptions, grade_in_kernels
from qlab.grading.similarity import write_similarity

__all__ = [
    "GradeOptions",
    "SubmissionRow",
    "grade_submission",
    "grade_many",
    "merge",
    "parse_shard",
    "shard_dir",
    "submission_keys",
]


def _read(path: Path, log: list[str]):
    """The notebook, or None when it cannot be read (the log says why)."""
    try:
        nb = read_notebook(path)
        if not isinstance(nb.get("cells"), list):
            raise ValueError("no list of cells")
    except Exception as e:  # noqa: BLE001 - any unreadable file is that submission's problem
        log.append(f"could not read the notebook: {type(e).__name__}: {str(e)[:200]}")
        return None
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:  # graded anyway: the cells are what count
        log.append(f"warning: the notebook does not validate ({str(e)[:120]})")
    return nb


def _code_cells(nb) -> list[str]:
    """The sources the grader runs: code cells that are not check (grade) cells."""
    return [
        c["source"]
        for c in nb["cells"]
        if isinstance(c, dict)
        and c.get("cell_type") == "code"
        and not is_grade_cell(c)
        and isinstance(c.get("source"), str)
        and c["source"].strip()
    ]


def _fail(task, msg: str) -> TaskResult:
    return TaskResult(task.grade_id, 0, task.points, False, msg)


def _isolation(opts: GradeOptions) -> GradeOptions:
    """opts with the isolation level resolved (once per run; the warning goes to stderr)."""
    if opts.isolation:
        return opts
    level = sandbox.resolve(opts.sandbox)
    if level.warning():
        print(level.warning(), file=sys.stderr)
    return replace(opts, isolation=level.level)


def grade_submission(path: str | Path, key: str, opts: GradeOptions) -> SubmissionRow:
    """Grade one notebook; never raises for a bad submission (the row says what happened)."""
    path, start, opts = Path(path), time.monotonic(), _isolation(opts)
    row = SubmissionRow(key, str(path), results.sha256_of(path), seed=opts.seed)
    row.isolation = opts.isolation
    link = path.is_symlink()
    nb = None if link else _read(path, row.log)
    row.assignment, row.flags = assignment_of(nb, path, list(assignments()), opts.assignment)
    if link:  # a link to another student's notebook or to a host file: never opened
        row.flags.append(f"symlink: {key} is a symbolic link; not followed, 0 points")
    if row.assignment is None:
        row.log.append("could not tell which assignment this is: pass --assignment")
        if link:
            row.status = results.GRADED
        return row
    tasks = assignment_tasks(row.assignment)
    if link:
        scores = {t.grade_id: _fail(t, "a symbolic link, not graded") for t in tasks}
    elif nb is None:
        scores = {t.grade_id: _fail(t, "the notebook could not be read") for t in tasks}
    else:
        cases = {t.grade_id: make_cases(t, case_seed(opts.seed, key, t.grade_id)) for t in tasks}
        base = Path(tempfile.mkdtemp(prefix="qlab-grade-"))
        try:
            scores = asyncio.run(
                grade_in_kernels(_code_cells(nb), tasks, cases, opts, base, row.log)
            )
        finally:
            shutil.rmtree(base, ignore_errors=True)
    kernel_failed = any(line.startswith("kernel error") for line in row.log)
    row.status = results.ERROR if kernel_failed else results.GRADED  # an error is retried
    for t in tasks:
        row.tasks[t.grade_id] = asdict(scores[t.grade_id])
        row.total += scores[t.grade_id].score
        row.max += scores[t.grade_id].max
    row.seconds = round(time.monotonic() - start, 2)
    return row


def printable(name: str) -> str:
    """A file name as text that any file and spreadsheet can hold: bytes that are not
    UTF-8 (e.g. Windows archives unzipped on Linux) become ``\\xff``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def submission_keys(paths: list[Path]) -> dict[str, Path]:
    """key -> path: the file stem, or as many parent folders as make it unique
    (``a/x_01_affine``, ``b/a/x_01_affine``); any bytes, never a refusal."""
    parts = {p: tuple(printable(x) for x in (*p.parent.parts, p.stem)) for p in paths}
    depth = max((len(v) for v in parts.values()), default=0)
    # count[n][suffix]: how many paths end in that suffix of n names
    count = [Counter(v[-n:] for v in parts.values()) for n in range(depth + 1)]
    keys: dict[str, Path] = {}
    for p, names in parts.items():
        n = 1
        while n < len(names) and count[n][names[-n:]] > 1:
            n += 1
        key, i = "/".join(names[-n:]), 1
        while key in keys:  # one path is a suffix of another: number the second
            i += 1
            key = f"{'/'.join(names[-n:])}#{i}"
        keys[key] = p
    return keys


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 1 <= I <= N."""
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise ValueError(f"--shard takes I/N with 1 <= I <= N (e.g. 3/8), got {text!r}")
    return int(i), int(n)


def shard_dir(out: Path, shard: tuple[int, int]) -> Path:
    return Path(out) / f"shard-{shard[0]}-of-{shard[1]}"


def _in_shard(key: str, shard: tuple[int, int] | None) -> bool:
    """Deterministic: a submission's shard depends on its key only (not on the others)."""
    if shard is None:
        return True
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") % shard[1] == shard[0] - 1


def _worker(item: tuple[str, str, GradeOptions]) -> SubmissionRow:
    import torch

    torch.set_num_threads(1)  # references are small; --jobs processes share the cores
    path, key, opts = item
    try:
        return grade_submission(path, key, opts)
    except Exception as e:  # noqa: BLE001 - a grader bug must not stop the class run
        row = SubmissionRow(key, path, results.sha256_of(Path(path)), seed=opts.seed)
        row.isolation, row.log = opts.isolation, [f"grader error: {e!r}"]
        return row


def _dead_row(item: tuple[str, str, GradeOptions], why: str) -> SubmissionRow:
    """The row of a submission whose worker process died: final, 0 points."""
    path, key, opts = item
    row = SubmissionRow(key, path, results.sha256_of(Path(path)), seed=opts.seed)
    row.status, row.isolation = results.WORKER_DIED, opts.isolation
    row.log = [
        f"the grader process grading this submission {why}; the notebook most likely "
        "killed it (e.g. os.kill(os.getppid(), ...) without a sandbox). 0 points; delete "
        "this row from grades.json to grade it again"
    ]
    return row


def _collect(paths: list[str | Path]) -> list[Path]:
    """The .ipynb files under the given folders (which may be links); links inside them
    are not followed (a link to a notebook is listed, and graded as a link: see
    grade_submission; a linked folder is not entered)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            files.append(p)
            continue
        for root, dirs, names in os.walk(p, followlinks=False):
            dirs.sort()
            files.extend(Path(root, n) for n in sorted(names) if n.endswith(".ipynb"))
    return files


def _flag_duplicates(rows: dict[str, SubmissionRow], hashes: dict[str, str]) -> None:
    """Flag submissions whose files are byte for byte the same (``duplicate: ...``)."""
    same: dict[str, list[str]] = {}
    for key, digest in hashes.items():
        if digest:
            same.setdefault(digest, []).append(key)
    for key, row in rows.items():
        row.flags = [f for f in row.flags if not f.startswith("duplicate:")]
        others = [k for k in same.get(hashes.get(key, ""), []) if k != key]
        if others:
            row.flags.append(f"duplicate: the same file as {', '.join(sorted(others)[:10])}")


def _prepare(opts: GradeOptions, paths, out: Path, header: dict) -> GradeOptions:
    """Seed (given, resumed, or fresh), isolation level, and the paths kernels must not see."""
    seed = opts.seed or int(header.get("seed") or 0) or secrets.randbits(62) + 1
    hide = tuple(str(Path(p).resolve()) for p in [*paths, out])
    opts = _isolation(replace(opts, seed=seed, hide=hide))
    problem = sandbox.hidden_paths_ok(list(hide)) if opts.isolation == sandbox.BWRAP else None
    if problem is not None:
        raise ValueError(problem)
    return opts


def grade_many(
    paths: list[str | Path],
    out: str | Path,
    jobs: int = 1,
    opts: GradeOptions | None = None,
    progress: bool = True,
    shard: tuple[int, int] | None = None,
) -> dict[str, SubmissionRow]:
    """Grade notebooks (resuming from the output's grades.json); returns {key: row}.

    With ``shard=(I, N)`` only that slice is graded, into OUT/shard-I-of-N/.
    """
    opts, top = opts or GradeOptions(), Path(out)
    out = shard_dir(top, shard) if shard else top
    out.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("ipykernel") is None:
        raise RuntimeError(f"ipykernel is not installed for {sys.executable}: pip install it")
    everyone = submission_keys(_collect(paths))
    hashes = {k: results.sha256_of(p) for k, p in everyone.items()}  # across shards
    keys = {k: p for k, p in everyone.items() if _in_shard(k, shard)}
    header, rows = results.load_results(out)
    todo = [
        (str(p), k)
        for k, p in keys.items()
        if results.needs_grading(rows.get(k), hashes[k], opts.assignment)
    ]
    if todo:  # the sandbox probe starts a Python with torch: only when there is work
        opts = _prepare(opts, paths, top, header)
    else:
        opts = replace(opts, seed=opts.seed or int(header.get("seed") or 0))
        opts.isolation = opts.isolation or header.get("isolation") or ""
    header = {"seed": opts.seed, "isolation": opts.isolation}
    header["shard"] = f"{shard[0]}/{shard[1]}" if shard else None
    order = list(all_tasks())
    from tqdm.auto import tqdm

    done = len(keys) - len(todo)
    bar = tqdm(total=len(keys), initial=done, unit="nb", desc="grading", disable=not progress)

    def save(item, row: SubmissionRow) -> None:
        rows[row.submission] = row
        _flag_duplicates(rows, hashes)
        results.write_results(out, rows, header, order)
        bar.update(1)

    try:
        deadline = 2 * opts.wall + opts.startup_timeout + 120  # a worker past this is stuck
        run_pool([(p, k, opts) for p, k in todo], jobs, _worker, save, _dead_row, deadline)
    finally:
        bar.close()
    _flag_duplicates(rows, hashes)
    results.write_results(out, rows, header, order)
    write_similarity(out, everyone, list(assignments()), opts.assignment)  # the whole class
    return rows


def merge(folders: list[str | Path], out: str | Path) -> dict:
    """Combine the shards' grades.json found under ``folders`` into OUT/grades.{json,csv},
    and write OUT/similarity.csv over every merged submission.

    The similarity report is computed again from the files the rows name (``path``, as the
    shard saw it): a file that is gone or no longer has the hash that was graded is left
    out and listed under ``similarity_skipped`` in the returned dict (with ``pairs``).
    """
    info = results.merge_results([Path(f) for f in folders], Path(out), list(all_tasks()))
    _, rows = results.load_results(Path(out))
    same = {k: Path(r.path) for k, r in rows.items() if _unchanged(r)}
    decided = {k: r.assignment for k, r in rows.items() if r.assignment}
    info["pairs"] = write_similarity(Path(out), same, list(assignments()), decided=decided)
    info["similarity_skipped"] = sorted(set(rows) - set(same))
    return info


def _unchanged(row: SubmissionRow) -> bool:
    """The row's file is still there, byte for byte as graded (a link: the same target)."""
    return bool(row.sha256) and results.sha256_of(Path(row.path)) == row.sha256
