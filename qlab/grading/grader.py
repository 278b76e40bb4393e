"""``qlab grade``: execute submitted notebooks in sandboxed kernels, check in this process.

For each submission (one worker process each, ``--jobs`` in parallel):
1. start a fresh ipykernel through ``_launch.py`` (memory/CPU rlimits, its own temp
   working directory, ``QLAB_GRADER_KERNEL=1``);
2. run the notebook's code cells with nbclient, skipping its check (grade) cells and
   keeping none of their outputs; errors are allowed; a cell that times out or kills
   the kernel is dropped and the kernel restarted (the earlier cells are re-run);
3. for each task of the assignment, send inputs that THIS process drew (seeded per run
   and submission) into the kernel, get plain data back (``_harness``), rebuild tensors
   here and compare with qlab computed here. A task whose call times out or kills the
   kernel scores 0 and the kernel is restarted for the next task.
Results are written atomically (tmp + os.replace) after every submission, so an
interrupted run resumes where it stopped (already graded files are skipped).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
import csv
import hashlib
import importlib.util
import io
import json
import logging
import multiprocessing
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from qlab.grading import _harness
from qlab.grading.check import GRADER_ENV
from qlab.grading.notebook import assignment_of, is_grade_cell, read_notebook
from qlab.grading.registry import (
    Task,
    TaskResult,
    all_tasks,
    assignment_tasks,
    assignments,
    case_seed,
    evaluate,
    make_cases,
)

__all__ = ["GradeOptions", "grade_submission", "grade_many"]

_KERNEL_NAME = "qlab-grader"
_HARNESS_SRC = Path(_harness.__file__).read_text(encoding="utf-8")
_LAUNCHER = str(Path(__file__).with_name("_launch.py"))
_RESULT_LIMIT = 64 * 2**20  # bytes of result text accepted from one task call
# nbclient logs every timeout and dead kernel as an error; those are expected here and
# end up in the submission's log instead
_QUIET = logging.getLogger("qlab.grading.nbclient")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


@dataclass
class GradeOptions:
    timeout: float = 30.0  # seconds per cell (notebook cells and each task call)
    wall: float = 300.0  # seconds per submission, everything included
    mem_mb: int = 4096  # address-space limit of the kernel
    seed: int = 0  # run seed; inputs = f(seed, submission, task)
    assignment: str | None = None  # force the assignment (else notebook metadata / name)
    startup_timeout: float = 60.0
    env: dict[str, str] = field(default_factory=dict)  # extra kernel environment variables


class _Client(NotebookClient):
    """nbclient that keeps no outputs, except the capped stdout of the grader's own cells."""

    capture: list | None = None
    captured_bytes: int = 0

    def output(self, outs, msg, display_id, cell_index):  # noqa: D401
        if self.capture is not None and msg["msg_type"] == "stream":
            text = msg["content"].get("text", "")
            if isinstance(text, str) and self.captured_bytes + len(text) <= _RESULT_LIMIT:
                self.capture.append(text)
                self.captured_bytes += len(text)
        return None

    def handle_comm_msg(self, outs, msg, cell_index):
        return None


async def _run_cell(client: _Client, source: str, capture: bool, timeout: int):
    """Run one code cell in the client's kernel; returns captured stdout pieces (or None)."""
    cell = nbformat.v4.new_code_cell(source)
    client.nb.cells.append(cell)
    client.capture = [] if capture else None
    client.captured_bytes = 0
    client.timeout = timeout
    await client.async_execute_cell(cell, len(client.nb.cells) - 1, store_history=False)
    return client.capture


def _kernel_dir(opts: GradeOptions, extra_env: dict[str, str]) -> str:
    root = tempfile.mkdtemp(prefix="qlab-kspec-")
    spec_dir = Path(root) / _KERNEL_NAME
    spec_dir.mkdir()
    env = {
        "QLAB_GRADER_MEM_BYTES": str(int(opts.mem_mb) * 2**20),
        "QLAB_GRADER_CPU_S": str(int(opts.wall) + 30),
        GRADER_ENV: "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
        "MPLBACKEND": "Agg",
        **extra_env,
    }
    spec = {
        "argv": [sys.executable, _LAUNCHER, "-f", "{connection_file}"],
        "display_name": "qlab grader (sandboxed)",
        "language": "python",
        "env": env,
        "metadata": {"debugger": False},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    return root


def _harness_cell(task: Task, cases: list, nonce: str) -> str:
    payload = base64.b64encode(
        json.dumps([_harness.encode(c) for c in cases], separators=(",", ":")).encode()
    ).decode("ascii")
    return (
        "exec(compile(" + repr(_HARNESS_SRC) + ", '<qlab grader>', 'exec'), "
        "__qlab_ns := {'__name__': '__qlab_grader__'})\n"
        f"__qlab_ns['_kernel_main'](globals(), {task.func_name!r}, {payload!r}, "
        f"{nonce!r}, {_RESULT_LIMIT})\n"
        "del __qlab_ns\n"
    )


def _parse(captured: list[str], nonce: str):
    text = "".join(captured)
    found = None
    for line in text.splitlines():
        if line.startswith(nonce + " "):
            found = line[len(nonce) + 1 :]
    if found is None:
        return None, "the grader's call produced no result (was stdout replaced?)"
    try:
        data = json.loads(found)
    except ValueError:
        return None, "unreadable result"
    if type(data) is not dict:
        return None, "unreadable result"
    if "missing" in data:
        return None, str(data["missing"])[:300]
    records = data.get("records")
    if type(records) is not list:
        return None, "unreadable result"
    return records, None


async def _grade_async(
    cells: list[str],
    tasks: list[Task],
    cases: dict[str, list],
    opts: GradeOptions,
    workdir: str,
    log: list[str],
) -> dict[str, TaskResult]:
    results: dict[str, TaskResult] = {}
    remaining = list(tasks)
    bad_cells: set[int] = set()
    deadline = time.monotonic() + opts.wall
    extra_env = {k: v for t in tasks for k, v in t.kernel_env.items()}
    kdir = _kernel_dir(opts, {**extra_env, **opts.env})
    try:
        while remaining:
            if time.monotonic() >= deadline:
                break
            km = AsyncKernelManager(
                kernel_name=_KERNEL_NAME,
                kernel_spec_manager=KernelSpecManager(kernel_dirs=[kdir]),
            )
            nb = nbformat.v4.new_notebook()
            client = _Client(
                nb,
                km=km,
                timeout=int(opts.timeout),
                allow_errors=True,
                interrupt_on_timeout=False,
                shutdown_kernel="immediate",
                startup_timeout=int(opts.startup_timeout),
                iopub_timeout=10,
                resources={"metadata": {"path": workdir}},
                record_timing=False,
                log=_QUIET,
            )

            def run(source: str, capture: bool, client: _Client = client):
                limit = max(1, int(min(opts.timeout, deadline - time.monotonic())))
                return _run_cell(client, source, capture, limit)

            try:
                async with client.async_setup_kernel(
                    cleanup_kc=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                ):
                    restart = False
                    for i, src in enumerate(cells):
                        if i in bad_cells:
                            continue
                        try:
                            await run(src, capture=False)
                        except CellTimeoutError:
                            log.append(f"notebook code cell {i + 1} timed out; skipped")
                            bad_cells.add(i)
                            restart = True
                        except DeadKernelError:
                            log.append(f"notebook code cell {i + 1} killed the kernel; skipped")
                            bad_cells.add(i)
                            restart = True
                        if restart or time.monotonic() >= deadline:
                            break
                    if restart:
                        continue
                    while remaining and time.monotonic() < deadline:
                        task = remaining[0]
                        nonce = "QLAB-" + secrets.token_hex(16)
                        try:
                            captured = await run(
                                _harness_cell(task, cases[task.grade_id], nonce), capture=True
                            )
                        except CellTimeoutError:
                            results[task.grade_id] = _fail(
                                task,
                                f"{task.func_name} did not finish within "
                                f"{client.timeout}s (infinite loop?)",
                            )
                            remaining.pop(0)
                            break
                        except DeadKernelError:
                            results[task.grade_id] = _fail(
                                task,
                                f"the kernel died while running {task.func_name} "
                                "(os._exit, a crash, or out of memory)",
                            )
                            remaining.pop(0)
                            break
                        records, missing = _parse(captured or [], nonce)
                        results[task.grade_id] = evaluate(
                            task, cases[task.grade_id], records, missing
                        )
                        remaining.pop(0)
            except Exception as e:  # noqa: BLE001 - the kernel failed to start or to talk
                log.append(f"kernel error: {type(e).__name__}: {e}")
                for task in remaining:
                    results[task.grade_id] = _fail(task, f"the kernel could not run: {e}")
                remaining = []
    finally:
        shutil.rmtree(kdir, ignore_errors=True)
    for task in remaining:
        results[task.grade_id] = _fail(
            task, f"not graded: the submission hit its wall-clock limit ({opts.wall:g}s)"
        )
    return results


def _fail(task: Task, msg: str) -> TaskResult:
    return TaskResult(task.grade_id, 0, task.points, False, msg)


def _sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def grade_submission(path: str | Path, key: str, opts: GradeOptions) -> dict:
    """Grade one notebook; never raises for a bad submission (the row says what happened)."""
    path = Path(path)
    start = time.monotonic()
    log: list[str] = []
    names = list(assignments())
    nb = None
    try:
        nb = read_notebook(path)
        if not isinstance(nb.get("cells"), list):
            raise ValueError("no list of cells")
    except Exception as e:  # noqa: BLE001 - any unreadable file is that submission's problem
        log.append(f"could not read the notebook: {type(e).__name__}: {str(e)[:200]}")
        nb = None
    if nb is not None:
        try:
            nbformat.validate(nb)
        except nbformat.ValidationError as e:  # graded anyway: the cells are what count
            log.append(f"warning: the notebook does not validate ({str(e)[:120]})")
    name = opts.assignment or assignment_of(nb, path, names)
    row = {
        "submission": key,
        "path": str(path),
        "sha256": _sha256(path),
        "assignment": name,
        "seed": opts.seed,
        "status": "graded",
        "tasks": {},
        "total": 0,
        "max": 0,
        "log": log,
    }
    if name is None:
        row["status"] = "error"
        log.append("could not tell which assignment this is: pass --assignment")
        return row
    tasks = assignment_tasks(name)
    if nb is None:
        results = {t.grade_id: _fail(t, "the notebook could not be read") for t in tasks}
    else:
        cells = [
            c["source"]
            for c in nb["cells"]
            if isinstance(c, dict)
            and c.get("cell_type") == "code"
            and not is_grade_cell(c)
            and isinstance(c.get("source"), str)
            and c["source"].strip()
        ]
        cases = {t.grade_id: make_cases(t, case_seed(opts.seed, key, t.grade_id)) for t in tasks}
        workdir = tempfile.mkdtemp(prefix="qlab-grade-")
        try:
            results = asyncio.run(_grade_async(cells, tasks, cases, opts, workdir, log))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if any(line.startswith("kernel error") for line in log):
        row["status"] = "error"  # not the student's doing (as far as we can tell): retry
    for t in tasks:
        r = results[t.grade_id]
        row["tasks"][t.grade_id] = asdict(r)
        row["total"] += r.score
        row["max"] += r.max
    row["seconds"] = round(time.monotonic() - start, 2)
    return row


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _write(out: Path, rows: dict[str, dict], seed: int) -> None:
    order = list(all_tasks())
    used = {g for r in rows.values() for g in r["tasks"]}
    cols = [g for g in order if g in used]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["submission", *cols, "total", "max"])
    for key in sorted(rows):
        r = rows[key]
        w.writerow(
            [
                key,
                *(r["tasks"][g]["score"] if g in r["tasks"] else "" for g in cols),
                r["total"],
                r["max"],
            ]
        )
    _atomic_write(out / "grades.csv", buf.getvalue())
    doc = {"seed": seed, "submissions": {k: rows[k] for k in sorted(rows)}}
    _atomic_write(out / "grades.json", json.dumps(doc, indent=1) + "\n")


def submission_keys(paths: list[Path]) -> dict[str, Path]:
    """file stem -> path; stems that collide get their parent folder as a prefix."""
    stems: dict[str, int] = {}
    for p in paths:
        stems[p.stem] = stems.get(p.stem, 0) + 1
    keys = {}
    for p in paths:
        key = p.stem if stems[p.stem] == 1 else f"{p.parent.name}/{p.stem}"
        if key in keys:
            raise ValueError(f"two submissions map to {key!r}: {keys[key]} and {p}")
        keys[key] = p
    return keys


def _error_row(key: str, path: str, sha256: str, seed: int, message: str) -> dict:
    """The CSV/JSON row of a submission the grader itself could not grade."""
    return {
        "submission": key,
        "path": path,
        "sha256": sha256,
        "assignment": None,
        "seed": seed,
        "status": "error",
        "tasks": {},
        "total": 0,
        "max": 0,
        "log": [message],
    }


def _worker(path: str, key: str, opts: GradeOptions) -> dict:
    import torch

    torch.set_num_threads(1)  # references are small; --jobs processes share the cores
    try:
        return grade_submission(path, key, opts)
    except Exception as e:  # noqa: BLE001 - a grader bug must not stop the class run
        return _error_row(key, path, _sha256(Path(path)), opts.seed, f"grader error: {e!r}")


def grade_many(
    paths: list[str | Path],
    out: str | Path,
    jobs: int = 1,
    opts: GradeOptions | None = None,
    progress: bool = True,
) -> dict[str, dict]:
    """Grade notebooks (resuming from out/grades.json); returns {submission: row}."""
    opts = opts or GradeOptions()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    for p in map(Path, paths):
        files.extend(sorted(p.rglob("*.ipynb")) if p.is_dir() else [p])
    if importlib.util.find_spec("ipykernel") is None:
        raise RuntimeError(f"ipykernel is not installed for {sys.executable}: pip install it")
    keys = submission_keys(files)
    rows: dict[str, dict] = {}
    prev = out / "grades.json"
    if prev.exists():
        try:
            old = json.loads(prev.read_text(encoding="utf-8"))
            rows = dict(old.get("submissions", {}))
            if not opts.seed:
                opts.seed = int(old.get("seed", 0))
        except (ValueError, OSError, AttributeError):
            rows = {}
    if not opts.seed:
        opts.seed = secrets.randbits(62) + 1
    todo = [
        (k, p)
        for k, p in keys.items()
        if not (
            k in rows and rows[k].get("status") == "graded" and rows[k].get("sha256") == _sha256(p)
        )
    ]
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(keys),
        initial=len(keys) - len(todo),
        unit="nb",
        desc="grading",
        disable=not progress,
    )
    try:
        if jobs <= 1:
            for k, p in todo:
                rows[k] = _worker(str(p), k, opts)
                _write(out, rows, opts.seed)
                bar.update(1)
        else:
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                futs = {pool.submit(_worker, str(p), k, opts): k for k, p in todo}
                for fut in cf.as_completed(futs):
                    k = futs[fut]
                    try:
                        rows[k] = fut.result()
                    except Exception as e:  # noqa: BLE001 - e.g. a worker killed by the OS
                        msg = f"grader worker failed: {e!r}"
                        rows[k] = _error_row(k, str(keys[k]), "", opts.seed, msg)
                    _write(out, rows, opts.seed)
                    bar.update(1)
    finally:
        bar.close()
    _write(out, rows, opts.seed)
    return rows
