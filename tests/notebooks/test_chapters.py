"""Every chapter runs top to bottom in a fresh kernel, so every figure it asserts holds.

The run is the site's (docs/site/build.py `execute`: nbclient, working directory
notebooks/, a 300 s cell timeout, the static-widget extension loaded), which checks what
`pytest --nbval-lax notebooks` checks: no cell raises. A failure names the chapter, the
cell and the error. Each executed chapter is kept for the site's browser test
(tests/site), so CI executes the chapters once, not twice.

The chapters execute in the background (CHAPTER_RUN, started by tests/conftest.py once the
session's tests are collected): one kernel at a time with one torch thread beside the other
tests, which are mostly single-threaded, or all usable CPUs when only chapters are selected.
Their tests go to the end of the session and wait for their chapter (under pytest -n, as
`make test` runs: to one worker, which starts the run at its first chapter test). The
session's summary lists each chapter's own execution time.
"""

import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("qlab_site_build", REPO / "docs/site/build.py")
site_build = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("qlab_site_build", site_build)
_spec.loader.exec_module(site_build)
CHAPTERS = site_build.numbered(REPO / "notebooks", None)


class ChapterRun:
    """Chapters executed in a background thread pool; ``result(path)`` waits for one."""

    def __init__(self) -> None:
        self.done: dict[Path, threading.Event] = {}
        self.results: dict[Path, nbformat.NotebookNode | Exception] = {}
        self.seconds: dict[Path, float] = {}
        self._lock = threading.Lock()
        # the environment the kernels start from, copied here (in the thread that makes
        # the run): pytest changes os.environ around every test, so copying it in the
        # run's threads could meet a key just removed (grading_bank.ClassRun does the same)
        self.environ = dict(os.environ)

    def start(self, paths: list[Path], jobs: int, threads: int | None) -> None:
        """Execute ``paths`` (those not started yet), ``jobs`` kernels at a time, each with
        ``threads`` torch threads (None: the policy's count)."""
        with self._lock:
            paths = [p for p in paths if p not in self.done]
            for path in paths:
                self.done[path] = threading.Event()
        if not paths:
            return

        def run(path: Path) -> None:
            start = time.monotonic()
            try:
                self.results[path] = site_build.execute(path, threads=threads, environ=self.environ)
            # a failed chapter (BuildError) or an error in this harness itself: the chapter's
            # test raises it; the queue goes on, nothing waits forever
            except Exception as e:
                self.results[path] = e
            finally:
                self.seconds[path] = time.monotonic() - start
                self.done[path].set()

        def worker() -> None:  # takes the next chapter until none is left
            while True:
                with self._lock:
                    if not paths:
                        return
                    path = paths.pop(0)
                run(path)

        # daemon threads: a session that ends early (-x, Ctrl+C) does not wait for the
        # chapters still queued, and their kernels end with this process (ipykernel
        # watches its parent)
        for _ in range(jobs):
            threading.Thread(target=worker, daemon=True, name="chapter-run").start()

    def result(self, path: Path) -> nbformat.NotebookNode:
        """The executed chapter (executed now, if nothing started it); raises what stopped
        it (BuildError: a cell failed, timed out or the kernel died)."""
        self.start([path], 1, None)
        self.done[path].wait()
        result = self.results[path]
        if isinstance(result, Exception):
            raise result
        return result

    def wait(self) -> None:
        """Until every chapter started has finished."""
        for event in list(self.done.values()):
            event.wait()


CHAPTER_RUN = ChapterRun()


def test_every_chapter_is_collected():
    assert len(CHAPTERS) >= 16 and CHAPTERS[0].name == "00_why_quantization.ipynb"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_top_to_bottom(path, executed_chapters, record_property):
    try:
        nb = CHAPTER_RUN.result(path)
    except site_build.BuildError as e:
        pytest.fail(str(e), pytrace=False)
    finally:  # the session's summary lists it (tests/conftest.py)
        record_property("chapter_seconds", (path.stem, CHAPTER_RUN.seconds[path]))
    nbformat.write(nb, executed_chapters / path.name)
