"""A submission's budget: memory, processes and disk for everything its kernels start.

Per-process rlimits (``_launch.py``) do not stop a notebook that forks: ten children of
2.5 GB each are 25 GB. So while a submission is graded, a supervisor thread in the
grading worker measures every process below it (the kernels, their sandboxes and what
the notebook started) every ``interval`` seconds and kills them all when, together, they
go past the budget:

- memory: the sum of the processes' private resident memory (``RssAnon + RssShmem`` of
  /proc/PID/status; pages a fork shares are counted in each process, so a fork-heavy
  notebook is stopped early rather than late);
- processes: the number of threads of those processes (what RLIMIT_NPROC counts);
- disk: the bytes in the submission's private folder on the host (result and socket
  folders; with the sandbox the kernel's working folder is a tmpfs of ``disk`` bytes).

The kernel then dies like any other crash (the cell or task that was running fails, the
kernel is restarted for the next task) and the log says which budget it broke. In the
bwrap sandbox every process a notebook starts stays below the grader (its PID namespace's
init adopts orphans); without the sandbox a process that detaches itself (double fork)
leaves the tree and is not counted. How far a burst overshoots between two measurements
is bounded by the per-process limits and the interval (in the sandbox RLIMIT_NPROC is
twice the process budget, at least 512, never above the user's hard limit, so a burst
that ends within one interval can reach that and go unseen);
tests/grading/test_grading_hostile.py measures the memory overshoot (a process burst's is
not measured).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Budget", "Supervisor", "descendants", "usage"]

_MAX_FILES = 10_000  # files in the private folder: more is a breach (and slow to measure)


@dataclass(frozen=True)
class Budget:
    mem_bytes: int  # private resident memory of all the submission's processes together
    threads: int  # threads (and so processes) of all of them together
    disk_bytes: int  # bytes in the submission's private folder (and its tmpfs)


def _read(path: str) -> bytes | None:
    """The bytes of a /proc file; None when it cannot be read (its process is gone). Raw
    os.open and os.read: half the CPU of Path.read_bytes in a scan of every process
    (measured), and no decoding (a process may name itself with any bytes)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        parts = [os.read(fd, 1 << 16)]
        while len(parts[-1]) == 1 << 16:  # a full buffer: there may be more
            parts.append(os.read(fd, 1 << 16))
        return b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)


def _ppids() -> dict[int, int]:
    """pid -> parent pid of every live process (zombies left out: they hold nothing)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read(f"/proc/{name}/stat")
        if stat is None:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split(None, 2)  # "pid (comm) state ppid ..."
        if fields[0] != b"Z":
            out[int(name)] = int(fields[1])
    return out


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (not root itself), parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _status(pid: int) -> tuple[int, int]:
    """(private resident bytes, threads) of one process; (0, 0) when it is gone."""
    text = _read(f"/proc/{pid}/status")
    if text is None:
        return 0, 0
    kb, threads = 0, 0
    for line in text.splitlines():
        key, _, value = line.partition(b":")
        if key in (b"RssAnon", b"RssShmem"):
            kb += int(value.split()[0])
        elif key == b"Threads":
            threads = int(value)
    return kb * 1024, threads


def _disk(folder: Path) -> int:
    total, files = 0, 0
    for root, _, names in os.walk(folder):
        for n in names:
            files += 1
            if files > _MAX_FILES:
                return 2**62
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return total


def usage(root: int, folder: Path | None = None) -> tuple[list[int], int, int, int]:
    """(pids, memory bytes, threads, disk bytes) of everything below ``root``."""
    pids = descendants(root)
    mem = threads = 0
    for pid in pids:
        m, t = _status(pid)
        mem, threads = mem + m, threads + t
    return pids, mem, threads, (_disk(folder) if folder is not None else 0)


class Supervisor(threading.Thread):
    """Watches the processes below ``root`` and kills them all past ``budget``.

    ``reason`` holds what the last kill was for (cleared by :meth:`take_reason`);
    ``peak_mem`` and ``peak_threads`` the largest totals it measured.
    """

    def __init__(self, budget: Budget, folder: Path | None = None, root: int | None = None,
                 interval: float = 0.05):
        super().__init__(daemon=True, name="qlab-budget")
        self.budget, self.folder, self.interval = budget, folder, interval
        self.root = os.getpid() if root is None else root
        self.reason: str | None = None
        self.peak_mem = self.peak_threads = 0
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop_event.set()
        self.join()

    def take_reason(self) -> str | None:
        with self._lock:
            reason, self.reason = self.reason, None
        return reason

    def _breach(self, mem: int, threads: int, disk: int) -> str | None:
        b = self.budget
        if mem > b.mem_bytes:
            return (
                f"its processes used more than {b.mem_bytes // 2**20} MB of memory together "
                f"(measured {mem // 2**20} MB)"
            )
        if threads > b.threads:
            return f"it ran more than {b.threads} processes and threads at once ({threads})"
        if disk > b.disk_bytes:
            return f"it wrote more than {b.disk_bytes // 2**20} MB of files ({disk // 2**20} MB)"
        return None

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                pids, mem, threads, disk = usage(self.root, self.folder)
            except OSError:
                continue
            self.peak_mem = max(self.peak_mem, mem)
            self.peak_threads = max(self.peak_threads, threads)
            why = self._breach(mem, threads, disk)
            if why is not None:
                with self._lock:
                    self.reason = why
                self.kill_all(pids)

    def kill_all(self, pids: list[int]) -> None:
        """SIGKILL these processes and whatever they start meanwhile (a fork loop), until
        none is left (10 s at most); a kernel the grader starts next is not theirs."""
        doomed, deadline = set(pids), time.monotonic() + 10
        while doomed and time.monotonic() < deadline:
            for pid in doomed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)
            alive = _ppids()
            doomed = {p for p in doomed if p in alive}
            doomed |= {p for p, parent in alive.items() if parent in doomed}
