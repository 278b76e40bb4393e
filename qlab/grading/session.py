"""One submission's kernels: run its code cells, then call each task's function on our inputs.

Steps (:func:`grade_in_kernels`):
1. start a kernel (:func:`_kernel`): through ``_launch.py`` (rlimits), inside a bwrap
   sandbox when the isolation level is ``"bwrap"`` (:mod:`qlab.grading.sandbox`), talking
   to this process over Unix sockets in a private folder (jupyter_client's ``ipc``
   transport: no network needed); a supervisor (:mod:`qlab.grading.budget`) holds all of
   the submission's processes to its memory, process and disk budget;
2. run a cell that wraps the qlab functions the tasks ask the learner to write and the
   registry's references (``_harness.install_watch``: calls are recorded per task), then
   the notebook's code cells (:func:`_run_notebook_cells`), keeping no outputs; a
   cell that times out or kills the kernel is dropped and the kernel restarted;
3. run the tasks one by one (:func:`_call_task`): a cell sends the inputs this process
   drew, the harness calls the student's function and writes plain data to a result file
   in the private folder; this process reads it with size and depth limits
   (:func:`read_result`) and compares with qlab here. A call that times out or kills the
   kernel costs that task, and the kernel is restarted for the next one.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
import signal
import site
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from qlab.grading._nbformat import nbformat  # before nbclient imports nbformat

# isort: split
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from qlab._tensor import thread_env
from qlab.grading import _harness
from qlab.grading.budget import Budget, Supervisor
from qlab.grading.check import GRADER_ENV, crash_message, is_kernel_task, kernel_guard
from qlab.grading.registry import Task, TaskResult, evaluate, size_limits
from qlab.grading.sandbox import BWRAP, PYTHON, bwrap_argv

__all__ = ["GradeOptions", "grade_in_kernels", "read_result", "parse_result", "RESULT_LIMIT"]

_KERNEL_NAME = "qlab-grader"
_HARNESS_SRC = Path(_harness.__file__).read_text(encoding="utf-8")
_LAUNCHER = str(Path(__file__).with_name("_launch.py"))
# bytes of one task call's result file; the largest legitimate result is well under 1 MB
RESULT_LIMIT = 16 * 2**20
# nbclient logs every timeout and dead kernel as an error; those are expected here and
# end up in the submission's log instead
_QUIET = logging.getLogger("qlab.grading.nbclient")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False

# the log keeps the first error of each of the first _MAX_RAISED notebook cells that raise
# one (escaped, at most _ERROR_CHARS characters)
_ERROR_CHARS, _MAX_RAISED = 200, 10


def _escape(text: str, limit: int) -> str:
    """Backslashes and what is not printable (escape codes, newlines) as Python writes them,
    whole escapes only, at most ``limit`` characters."""
    out, n = [], 0
    for c in text:
        e = repr(c)[1:-1] if c == "\\" or not c.isprintable() else c
        if n + len(e) > limit:
            break
        out.append(e)
        n += len(e)
    return "".join(out)


@dataclass
class GradeOptions:
    timeout: float = 30.0  # seconds per cell (notebook cells and each task call)
    wall: float = 300.0  # seconds per submission, everything included
    mem_mb: int = 4096  # memory of the submission's processes together (and of each one)
    procs: int = 256  # processes and threads of the submission together
    disk_mb: int = 1024  # bytes the submission may write (its private tmpfs with bwrap)
    seed: int = 0  # run seed; inputs = f(seed, submission, task)
    assignment: str | None = None  # force the assignment (else file name / metadata)
    startup_timeout: float = 60.0
    env: dict[str, str] = field(default_factory=dict)  # extra kernel environment variables
    sandbox: str = "auto"  # "auto" (bwrap if it works), "on" (bwrap or stop), "off"
    isolation: str = ""  # the level in use ("bwrap" or "none"), set by the grader
    hide: tuple[str, ...] = ()  # paths the kernels must not see (submissions, output)
    forbid_reference: bool = False  # a task whose function calls a reference scores 0


class _Client(NotebookClient):
    """nbclient that keeps no outputs (results come back through a file, not stdout), only
    the error the last cell raised, for the log (``error``: "Name: message", or None; from
    the cell's execute reply, not from tracebacks a cell displays)."""

    error: str | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, on_cell_error=self._raised, **kwargs)

    def _raised(self, cell, cell_index, execute_reply) -> None:
        content = execute_reply["content"]
        name, value = str(content.get("ename", "?")), str(content.get("evalue", ""))
        self.error = _escape(f"{name}: {value}" if value else name, _ERROR_CHARS)

    def output(self, outs, msg, display_id, cell_index):  # noqa: D401
        return None

    def handle_comm_msg(self, outs, msg, cell_index):
        return None


@dataclass
class _Progress:
    """The state of one submission across kernel restarts."""

    cells: list[str]
    remaining: list[Task]
    cases: dict[str, list]
    deadline: float
    log: list[str]
    bad_cells: set[int] = field(default_factory=set)
    raised: set[int] = field(default_factory=set)  # cells whose error is in the log
    results: dict[str, TaskResult] = field(default_factory=dict)
    starts: int = 0
    supervisor: Supervisor | None = None

    def over_budget(self) -> str | None:
        """Why the budget supervisor killed the kernel just now, or None."""
        return self.supervisor.take_reason() if self.supervisor is not None else None

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def _fail(task: Task, msg: str) -> TaskResult:
    return TaskResult(task.grade_id, 0, task.points, False, msg)


def kernel_env(opts: GradeOptions, work: Path, tasks: list[Task]) -> dict[str, str]:
    """The grading kernel's environment: limits, quiet libraries, every cache in ``work``."""
    return {
        "QLAB_GRADER_MEM_BYTES": str(int(opts.mem_mb) * 2**20),
        "QLAB_GRADER_CPU_S": str(int(opts.wall) + 30),
        GRADER_ENV: "1",
        # one torch thread, waiting passively: --jobs kernels share the cores (qlab/_tensor.py)
        **thread_env(1),
        "PYTHONHASHSEED": "0",
        "MPLBACKEND": "Agg",
        "HOME": str(work),
        "TMPDIR": str(work / "tmp"),
        "IPYTHONDIR": str(work / ".ipython"),
        "XDG_CACHE_HOME": str(work / ".cache"),
        "XDG_CONFIG_HOME": str(work / ".config"),
        "MPLCONFIGDIR": str(work / ".config" / "matplotlib"),
        "TRITON_CACHE_DIR": str(work / ".triton"),
        "PYTHONUSERBASE": site.getuserbase(),  # HOME moved: keep finding user packages
        # twice the budget: the supervisor stops a submission past --procs and says so.
        # At --procs itself the fork past the budget was refused (EAGAIN in the notebook),
        # so the supervisor saw at most one process more (bwrap's, outside the namespace)
        # and caught the breach only when its 50 ms sample fell on that moment. At least
        # 512: before Linux 5.14 it counts all of the user's processes, so a small budget's
        # backstop would refuse the kernels of a user who runs a few hundred of them
        **({"QLAB_GRADER_NPROC": str(max(2 * int(opts.procs), 512))}
           if opts.isolation == BWRAP else {}),
        **{k: v for t in tasks for k, v in t.kernel_env.items()},
        **opts.env,
    }


def _write_spec(base: Path, n: int, chan: Path, opts: GradeOptions, env: dict) -> str:
    """A kernel spec folder for kernel start ``n``; returns the folder to search."""
    argv = [PYTHON, _LAUNCHER, "-f", "{connection_file}", "--HistoryManager.enabled=False"]
    if opts.isolation == BWRAP:
        work = env["HOME"]
        quota = {work: int(opts.disk_mb) * 2**20}
        argv = [*bwrap_argv([str(chan)], list(opts.hide), env, work, quota), "--", *argv]
    root = base / f"spec{n}"
    (root / _KERNEL_NAME).mkdir(parents=True)
    spec = {
        "argv": argv,
        "display_name": f"qlab grader ({opts.isolation or 'none'})",
        "language": "python",
        "env": env,
        "metadata": {"debugger": False},
    }
    (root / _KERNEL_NAME / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    return str(root)


@contextlib.asynccontextmanager
async def _kernel(opts: GradeOptions, base: Path, env: dict, run: _Progress):
    """A fresh kernel with its own socket folder; yields (client, folder, folder's fd)."""
    run.starts += 1
    chan = base / f"k{run.starts}"
    chan.mkdir(mode=0o700)
    km = AsyncKernelManager(
        kernel_name=_KERNEL_NAME,
        kernel_spec_manager=KernelSpecManager(
            kernel_dirs=[_write_spec(base, run.starts, chan, opts, env)]
        ),
        transport="ipc",  # Unix sockets in the kernel's own folder: no network needed
        ip=str(chan / "s"),
        connection_file=str(chan / "connection.json"),
    )
    client = _Client(
        nbformat.v4.new_notebook(),
        km=km,
        timeout=int(opts.timeout),
        allow_errors=True,
        interrupt_on_timeout=False,
        shutdown_kernel="immediate",
        startup_timeout=int(opts.startup_timeout),
        iopub_timeout=10,
        resources={"metadata": {"path": env["HOME"]}},
        record_timing=False,
        log=_QUIET,
    )
    chan_fd = os.open(chan, os.O_RDONLY | os.O_DIRECTORY)
    try:
        async with client.async_setup_kernel(
            cleanup_kc=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ):
            yield client, chan, chan_fd
    finally:
        os.close(chan_fd)


async def _run_cell(client: _Client, source: str, run: _Progress, limit: float) -> None:
    cell = nbformat.v4.new_code_cell(source)
    client.nb.cells.append(cell)
    client.timeout = max(1, int(min(limit, run.seconds_left())))
    client.error = None
    await client.async_execute_cell(cell, len(client.nb.cells) - 1, store_history=False)


async def _run_notebook_cells(client: _Client, run: _Progress, timeout: float) -> bool:
    """Run every code cell not yet dropped; False when one was dropped (restart the kernel)."""
    for i, src in enumerate(run.cells):
        if i in run.bad_cells:
            continue
        if run.seconds_left() <= 0:
            return False
        try:
            await _run_cell(client, src, run, timeout)
        except CellTimeoutError:
            run.log.append(f"notebook code cell {i + 1} timed out; skipped")
        except DeadKernelError:
            why = run.over_budget()
            note = f" (over its budget: {why})" if why else ""
            run.log.append(f"notebook code cell {i + 1} killed the kernel{note}; skipped")
        else:
            if client.error is not None and i not in run.raised:  # said once, kept running
                run.raised.add(i)
                if len(run.raised) <= _MAX_RAISED:
                    run.log.append(f"notebook code cell {i + 1} raised {client.error}")
                elif len(run.raised) == _MAX_RAISED + 1:
                    run.log.append(f"more cells raised errors (the first {_MAX_RAISED} above)")
            continue
        run.bad_cells.add(i)
        return False
    return True


def _harness_cell(task: Task, cases: list, result_path: str) -> str:
    payload = base64.b64encode(
        json.dumps([_harness.encode(c) for c in cases], separators=(",", ":")).encode()
    ).decode("ascii")
    guard = kernel_guard(task)
    guard_src = Path(guard.__file__).read_text(encoding="utf-8") if guard else None
    sizes, rule = size_limits(task, cases)
    return (
        "exec(compile(" + repr(_HARNESS_SRC) + ", '<qlab grader>', 'exec'), "
        "__qlab_ns := {'__name__': '__qlab_grader__'})\n"
        f"__qlab_ns['_kernel_main'](globals(), {task.func_name!r}, {payload!r}, "
        f"{result_path!r}, {RESULT_LIMIT}, {guard_src!r}, {task.implements!r}, "
        f"{sizes!r}, {rule!r})\n"
        "del __qlab_ns\n"
    )


def _watch_cell(tasks: list[Task]) -> str:
    """The first cell of every kernel: wrap the references the tasks could borrow
    (before the notebook's cells run, so that its imports bind the wrappers)."""
    targets = sorted({name for t in tasks for name in t.implements})
    return (
        "exec(compile(" + repr(_HARNESS_SRC) + ", '<qlab grader>', 'exec'), "
        "__qlab_ns := {'__name__': '__qlab_grader__'})\n"
        f"__qlab_ns['install_watch']({targets!r}, globals())\n"
        "del __qlab_ns\n"
    )


def _exit_note(client: _Client) -> str | None:
    """'signal SIGSEGV' when the dead kernel (or its sandbox: 128 + n) says so, else None."""
    try:
        code = client.km.provisioner.process.poll()
    except AttributeError:
        code = None
    sig = -code if code is not None and code < 0 else (code - 128 if code and code > 128 else 0)
    if not sig:
        return None
    try:
        return f"signal {signal.Signals(sig).name}"
    except ValueError:
        return f"signal {sig}"


def _death_message(task: Task, note: str | None) -> str:
    if is_kernel_task(task):
        return crash_message(task, note or "the kernel process died")
    why = f"{note}: " if note else ""
    return (
        f"the kernel died while running {task.func_name} ({why}os._exit, a crash, or out of memory)"
    )


async def _call_task(client, chan: Path, chan_fd: int, task: Task, run: _Progress, opts):
    """Score one task in the running kernel; (result, restart the kernel?)."""
    name = f"result-{secrets.token_hex(16)}.json"
    cases = run.cases[task.grade_id]
    try:
        await _run_cell(client, _harness_cell(task, cases, str(chan / name)), run, opts.timeout)
    except CellTimeoutError:
        how = f"did not finish within {client.timeout} s"
        return _fail(task, crash_message(task, how)), True
    except DeadKernelError:
        why = run.over_budget()
        if why:
            msg = f"{task.func_name}: the submission went over its budget ({why}); killed"
            return _fail(task, msg), True
        return _fail(task, _death_message(task, _exit_note(client))), True
    records, missing = read_result(chan_fd, name, RESULT_LIMIT)
    return evaluate(task, cases, records, missing, opts.forbid_reference), False


async def _run_tasks(client, chan: Path, chan_fd: int, run: _Progress, opts) -> None:
    """Grade the remaining tasks until one needs a fresh kernel or time is up."""
    while run.remaining and run.seconds_left() > 0:
        task = run.remaining.pop(0)
        result, restart = await _call_task(client, chan, chan_fd, task, run, opts)
        run.results[task.grade_id] = result
        if restart:
            return


async def grade_in_kernels(
    cells: list[str],
    tasks: list[Task],
    cases: dict[str, list],
    opts: GradeOptions,
    base: Path,
    log: list[str],
) -> dict[str, TaskResult]:
    """Every task's result (grade_id -> TaskResult); ``base`` is a private temp folder."""
    run = _Progress(cells, list(tasks), cases, time.monotonic() + opts.wall, log)
    work = base / "work"
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    env = kernel_env(opts, work, tasks)
    budget = Budget(int(opts.mem_mb) * 2**20, int(opts.procs), int(opts.disk_mb) * 2**20)
    with Supervisor(budget, base) as run.supervisor:
        await _grade_loop(run, opts, base, env, tasks)
    sup = run.supervisor
    log.append(f"peak memory of its processes together: {sup.peak_mem // 2**20} MB, "
               f"peak processes and threads: {sup.peak_threads}")
    for task in run.remaining:
        run.results[task.grade_id] = _fail(
            task, f"not graded: the submission hit its wall-clock limit ({opts.wall:g}s)"
        )
    return run.results


async def _grade_loop(run: _Progress, opts: GradeOptions, base: Path, env: dict, tasks) -> None:
    """Start kernels until every task has a result or the wall clock runs out."""
    log = run.log
    while run.remaining and run.seconds_left() > 0:
        try:
            async with _kernel(opts, base, env, run) as (client, chan, chan_fd):
                try:
                    await _run_cell(client, _watch_cell(tasks), run, opts.startup_timeout)
                except (CellTimeoutError, DeadKernelError):
                    if run.seconds_left() <= 1:
                        return  # the wall clock ran out: the tasks left say so
                    raise
                if await _run_notebook_cells(client, run, opts.timeout):
                    await _run_tasks(client, chan, chan_fd, run, opts)
        except Exception as e:  # noqa: BLE001 - the kernel failed to start or to talk
            log.append(f"kernel error: {type(e).__name__}: {str(e)[:300]}")
            for task in run.remaining:
                run.results[task.grade_id] = _fail(task, f"the kernel could not run: {e}")
            run.remaining = []


def read_result(dir_fd: int, name: str, limit: int) -> tuple[list | None, str | None]:
    """(records, None) or (None, why not) from a result file, reading at most ``limit`` bytes.

    Opened relative to the folder's descriptor, without following links and only if it
    is a regular file: a kernel cannot point the grader at /dev/zero or another file.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, "no result came back from the kernel (the call ended without one)"
    except OSError as e:
        return None, f"unreadable result ({e.strerror})"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "unreadable result (not a file)"
        if info.st_size > limit:
            return None, f"the result is larger than {limit // 2**20} MB; return less data"
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > limit:
        return None, f"the result is larger than {limit // 2**20} MB; return less data"
    return parse_result(data)


def parse_result(data: bytes) -> tuple[list | None, str | None]:
    """Parse a result document; depth is bounded by the recursion limit, then by decode()."""
    try:
        doc = json.loads(data)
    except RecursionError:
        return None, "the result is nested too deeply to read"
    except ValueError:
        return None, "unreadable result (not JSON)"
    if type(doc) is not dict:
        return None, "unreadable result"
    if "missing" in doc:
        return None, str(doc["missing"])[:300]
    records = doc.get("records")
    if type(records) is not list:
        return None, "unreadable result"
    return records, None
