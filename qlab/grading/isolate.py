"""Run a learner's function in a forked child, so that a crash costs a FAIL line, not the kernel.

``check`` uses this for kernel tasks: an unmasked ``tl.store`` on Triton's CPU interpreter
writes outside its tensor and corrupts the heap, which ends the process with a segfault,
"double free or corruption", or a hang. In a child that happens to the child only; the
notebook's kernel reports it and keeps its state.

How the child gets the function: ``os.fork()`` (Linux), so the learner's function, its
globals and the Triton kernels it launches are simply there, with no pickling. The child
writes one JSON record per case to a pipe as each finishes (so a crash names its case),
its stdout/stderr (file descriptors 1 and 2 included: glibc's "double free" message) go
to a temporary file that the parent prints afterwards, and it ends with ``os._exit``.
Elsewhere (macOS, Windows: Triton has no wheels there, so kernel tasks do not run
anyway) and after CUDA is initialised in this process (CUDA does not survive a fork),
the function runs in this process instead: :func:`can_fork` says which.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

from qlab.grading import _harness

__all__ = ["ChildResult", "can_fork", "run_in_child"]

_OUTPUT_LIMIT = 20_000  # characters of the child's output shown in the notebook


@dataclass
class ChildResult:
    records: list[dict] = field(default_factory=list)  # one per case that finished
    crash: str | None = None  # how the child ended early: "signal SIGSEGV", "timed out"...
    output: str = ""  # what the child printed (the end of it)


def can_fork() -> str | None:
    """None when kernel checks can run in a forked child here, else the reason they cannot."""
    if not sys.platform.startswith("linux"):
        return f"no fork-based isolation on {sys.platform}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process and does not survive a fork"
    return None


def _child(fn: Callable, cases: list, guard, write_fd: int, out_fd: int, limits, rule) -> None:
    """In the child: redirect output, run each case, send its record; never returns."""
    try:
        faulthandler.disable()  # a crash here is reported by the parent, not dumped
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
        with os.fdopen(write_fd, "w", buffering=1) as pipe:
            for i, case in enumerate(cases):
                limit = [limits[i]] if limits else None
                record = _harness.run_cases(fn, [case], guard, True, limit, rule)[0]
                pipe.write(json.dumps(record, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    finally:
        os._exit(0)


def _read_all(fd: int, deadline: float) -> tuple[bytes, bool]:
    """Read the pipe until EOF or the deadline; (data, timed_out)."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            data = os.read(fd, 1 << 20)
            if not data:
                return b"".join(chunks), False
            chunks.append(data)


def _ending(status: int, timed_out: bool, timeout: float) -> str | None:
    if timed_out:
        return f"did not finish within {timeout:g} s"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"signal {signal.Signals(sig).name}"
        except ValueError:
            return f"signal {sig}"
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    return None if code == 0 else f"exit code {code}"


def run_in_child(
    fn: Callable, cases: list, timeout: float, guard=None, limits=None, rule: str = ""
) -> ChildResult:
    """Run fn on each case in a forked child (Linux); see the module docstring.
    ``limits``, ``rule``: per-case size limits (``_harness.run_cases``), or None."""
    read_fd, write_fd = os.pipe()
    out = tempfile.TemporaryFile()
    with warnings.catch_warnings():  # Python 3.12+ warns about fork in threaded processes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(fn, cases, guard, write_fd, out.fileno(), limits, rule)
    os.close(write_fd)
    timed_out = True
    try:
        data, timed_out = _read_all(read_fd, time.monotonic() + timeout)
    finally:
        os.close(read_fd)
        if timed_out:
            os.kill(pid, signal.SIGKILL)  # also on KeyboardInterrupt: no child outlives check
        _, status = os.waitpid(pid, 0)
    result = ChildResult(crash=_ending(status, timed_out, timeout))
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            result.records.append(json.loads(line))
        except ValueError:
            break  # the last line of a child that died while writing it
    out.seek(0, os.SEEK_END)
    size = out.tell()
    out.seek(max(0, size - 4 * _OUTPUT_LIMIT))
    text = out.read().decode("utf-8", "replace")
    out.close()
    result.output = text[-_OUTPUT_LIMIT:]
    if result.crash is None and len(result.records) < len(cases):
        result.crash = "the child process ended early"
    return result
