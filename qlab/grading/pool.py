"""Worker processes that grade submissions; a dead worker costs only the submission it had.

Each worker is a spawned process that grades one submission at a time (``work(item)``)
and sends the row back over its own pipe. When a worker dies (a kernel that killed its
parent without a sandbox, the OS's out-of-memory killer, a grader bug that crashed the
interpreter) or stays silent past its deadline, the pool knows exactly which submission
it held: that one gets ``on_dead(item, why)`` as its row, a fresh worker takes its place,
and the others carry on. ``--jobs 1`` uses one such worker too, so the main process
(which writes the results) never runs student-facing code.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

__all__ = ["run_pool"]


def _serve(conn, work: Callable[[Any], Any]) -> None:
    """A worker's loop: receive an item, send its result; None ends it."""
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        conn.send(work(item))


@dataclass
class _Worker:
    proc: Any
    conn: Any
    item: Any = None
    deadline: float = 0.0


def _start(ctx, work) -> _Worker:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, work), daemon=True)
    proc.start()
    child.close()
    return _Worker(proc, parent)


def _why_dead(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _retire(w: _Worker) -> str:
    """End a worker that died or ran past its deadline; says which."""
    w.proc.join(timeout=2)
    why = _why_dead(w.proc) if not w.proc.is_alive() else "stopped responding (killed)"
    w.proc.kill()
    w.proc.join()
    w.conn.close()
    return why


def _stop(w: _Worker) -> None:
    try:
        w.conn.send(None)
    except (OSError, ValueError):
        pass
    w.proc.join(timeout=5)
    if w.proc.is_alive():
        w.proc.kill()
        w.proc.join()
    w.conn.close()


def run_pool(
    items: list,
    jobs: int,
    work: Callable[[Any], Any],
    on_result: Callable[[Any, Any], None],
    on_dead: Callable[[Any, str], Any],
    deadline_s: float,
) -> None:
    """Run ``work(item)`` for every item on ``jobs`` workers; results go to on_result.

    work must be a picklable module-level function. ``on_dead(item, why)`` makes the
    result of an item whose worker died or ran past ``deadline_s`` seconds.
    """
    if not items:
        return
    ctx = multiprocessing.get_context("spawn")
    queue = list(items)
    workers: list[_Worker | None] = [_start(ctx, work) for _ in range(min(jobs, len(queue)))]
    try:
        while queue or any(w is not None and w.item is not None for w in workers):
            for w in workers:
                if w is not None and w.item is None and queue:
                    w.item, w.deadline = queue.pop(0), time.monotonic() + deadline_s
                    try:
                        w.conn.send(w.item)
                    except OSError:
                        pass  # it died before taking the item: handled below
            busy = [w for w in workers if w is not None and w.item is not None]
            wait([x for w in busy for x in (w.conn, w.proc.sentinel)], timeout=5)
            for i, w in enumerate(workers):
                if w is None or w.item is None:
                    continue
                if w.conn.poll():
                    try:
                        result = w.conn.recv()
                    except (EOFError, OSError):
                        pass  # it died while sending: handled below
                    else:
                        on_result(w.item, result)
                        w.item = None
                        continue
                elif w.proc.is_alive() and time.monotonic() < w.deadline:
                    continue
                on_result(w.item, on_dead(w.item, _retire(w)))
                workers[i] = _start(ctx, work) if queue else None
    finally:
        for w in workers:
            if w is not None:
                _stop(w)
