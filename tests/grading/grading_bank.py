"""Known-wrong implementations and submission builders for the grader's tests.

MUTANTS[grade_id] = [(name, cell source), ...]: each replaces that task's solution cell
and must fail `check` on every seed tried, and cost exactly that task's points in the
notebooks the class runs grade. Each chapter's bank is a ``tests/grading/mutants_*.py``
module (a ``MUTANTS`` dict of that form, at least one mutant per spec clause; chapters
08-10 share ``mutants_kernels.py``); they are merged in below.
Submissions are built from solutions/ by swapping cell sources, so they track the
solution notebooks automatically.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"

# grade_id -> [(name, cell source), ...], merged below from every mutants_*.py
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


Cases = dict[str, tuple[str, "nbformat.NotebookNode | str", set[str]]]
Command = list[str]


class ClassRun:
    """One ``qlab grade`` run of a class of submissions, in child processes.

    ``cases()`` gives name -> (assignment, notebook or raw text, grade_ids that must score
    0); ``argv`` the options after ``qlab grade SUBS --out OUT`` but ``--jobs``. A test
    module that defines ``CLASS_RUN = ClassRun(...)`` gets it started when the session's
    tests are collected, with ``--jobs`` = the CPUs this process may use less the one the
    tests before it need, and its tests moved to the end of the session
    (tests/conftest.py): the run grades on the cores the mostly single-threaded tests leave
    free, and :meth:`result` waits for it. Run on its own, ``result()`` starts it with
    every usable CPU and waits.

    A class that is more than notebooks (links, sub-folders, files beside it) comes from
    ``write(folder)`` instead, which writes it under the run's folder and returns (the
    folder to grade, anything the tests need: ``result()["written"]``). A run that is not
    one plain command comes from ``commands(subs, out, jobs)``: groups run one after
    another, the commands of a group at the same time, each with ``cwd`` and ``env``.
    """

    def __init__(
        self,
        cases: Callable[[], Cases] | None = None,
        argv: list[str] | None = None,
        limit_s: float = 1800,
        *,
        write: Callable[[Path], tuple[Path, object]] | None = None,
        commands: Callable[[Path, Path, int], list[list[Command]]] | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        assert (cases is None) != (write is None), "give cases or write, not both"
        self.cases, self.argv, self.limit_s = cases, list(argv or []), limit_s
        self.write, self.commands, self.cwd = write, commands, cwd
        # Always an explicit environment, copied here (in the thread that makes the run).
        # Started from the run's thread without one, a child (vfork) execs with the C
        # `environ` that the main thread changes meanwhile (pytest sets and removes
        # PYTEST_CURRENT_TEST around every test; monkeypatch too): OSError(14, 'Bad
        # address') in CI. And copying os.environ key by key in that thread can meet a
        # key just removed.
        self.env = dict(os.environ if env is None else env)
        self.procs: list[subprocess.Popen] = []
        self.returncode: int | None = None
        self.error: BaseException | None = None
        self.folder: Path | None = None
        self.subs: Path | None = None
        self.written: object = None
        self.seconds: float | None = None
        self.jobs = 0
        self.done = threading.Event()
        self._started = self._stopped = False
        self._lock = threading.Lock()

    def start(self, jobs: int | None = None) -> None:
        """Write the submissions and start grading them (once), ``jobs`` at a time."""
        from qlab._tensor import usable_cpus

        with self._lock:
            if self._started:
                return
            self._started = True
            try:
                self.jobs = jobs or usable_cpus()
                self.folder = Path(tempfile.mkdtemp(prefix="qlab-class-run-"))
                out = self.folder / "out"
                if self.write is not None:
                    self.subs, self.written = self.write(self.folder)
                else:
                    self.subs, self.written = self.folder / "submissions", self.cases()
                    self.subs.mkdir()
                    for name, (_, nb, _) in self.written.items():
                        path = self.subs / f"{name}.ipynb"
                        if isinstance(nb, str):
                            path.write_text(nb)
                        else:
                            nbformat.write(nb, str(path))
                if self.commands is not None:
                    groups = self.commands(self.subs, out, self.jobs)
                else:
                    grade = [sys.executable, "-m", "qlab.cli", "grade", str(self.subs)]
                    groups = [[[*grade, "--out", str(out), "--jobs", str(self.jobs),
                                *self.argv, "--quiet"]]]
            except BaseException as e:  # result() reports it instead of waiting
                self.error = e
                self.done.set()
                raise
        threading.Thread(target=self._run, args=(groups, time.monotonic()), daemon=True).start()

    def _run(self, groups: list[list[Command]], started: float) -> None:
        try:
            with open(self.folder / "log.txt", "w") as log:
                for group in groups:
                    with self._lock:
                        if self._stopped:
                            return
                        procs = [
                            subprocess.Popen(
                                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                env=self.env,
                                start_new_session=True,  # stop() ends workers and kernels
                            )
                            for cmd in group
                        ]
                        self.procs += procs
                    codes = [p.wait() for p in procs]
                    self.returncode = next((c for c in codes if c), 0)
                    if self.returncode:
                        return
        except BaseException as e:
            self.error = e
        finally:
            self.seconds = time.monotonic() - started
            self.done.set()

    def result(self) -> dict:
        """subs, out, doc (grades.json), rows (grades.csv), seconds, jobs, log, written;
        fails on a return code other than 0."""
        self.start()
        if not self.done.wait(self.limit_s):
            self.stop()
            raise AssertionError(f"`qlab grade` took longer than {self.limit_s:g} s")
        if self.error is not None:
            raise AssertionError(f"the class run failed: {self.error!r}") from self.error
        out = self.folder / "out"
        log = (self.folder / "log.txt").read_text(errors="replace")
        assert self.returncode == 0, f"exit status {self.returncode}: {log[-3000:]}"
        doc = json.loads((out / "grades.json").read_text())
        with open(out / "grades.csv", newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        return {"subs": self.subs, "out": out, "doc": doc, "rows": rows,
                "seconds": self.seconds, "jobs": self.jobs, "log": log, "written": self.written}

    def stop(self) -> None:
        """End the run if it still runs; remove its folder."""
        with self._lock:
            self._stopped = True
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
