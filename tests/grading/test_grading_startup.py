"""What `qlab grade` spends besides grading, kept cheap: nbformat imported without jsonschema's
rfc3987_syntax (qlab/grading/_nbformat.py) in each of its processes, and the budget
supervisor reading a submission's process tree from its root (budget.descendants, 20 times
a second), which must find what the whole of /proc shows."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from qlab.grading import budget


def test_the_grader_imports_nbformat_without_rfc3987_syntax_and_leaves_it_importable():
    code = (
        "import sys\nimport qlab.grading.grader, qlab.grading.session\n"
        "print(*(m in sys.modules for m in ('jsonschema', 'rfc3987_syntax', 'lark')))\n"
        "import nbformat, rfc3987_syntax\n"
        "nbformat.validate(nbformat.v4.new_notebook())\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False", "ok"]


def _both(root: int) -> tuple[list[int], list[int]]:
    """descendants(root) read from the children files, and from the whole of /proc."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(budget, "_CHILDREN_FILES", False)  # the fallback: every /proc/PID/stat
        whole = budget.descendants(root)
    return budget.descendants(root), whole


def test_the_supervisor_finds_the_tree_that_the_whole_proc_shows():
    assert budget._CHILDREN_FILES  # Linux with CONFIG_PROC_CHILDREN, as on the course machine
    # three deep, with a zombie (`true`, never reaped: its parent exec'd sleep) left out
    tree = subprocess.Popen(
        ["sh", "-c", "sh -c 'true & exec sleep 30' & sh -c 'sleep 30 & wait' & wait"]
    )
    # a child of a thread that is not the main one, listed in that thread's children file
    # while the thread lives (Linux gives an exited thread's children to another live one)
    from_thread: list[subprocess.Popen] = []
    started, done = threading.Event(), threading.Event()

    def spawn() -> None:
        from_thread.append(subprocess.Popen(["sleep", "30"]))
        started.set()
        done.wait(30)

    t = threading.Thread(target=spawn)
    t.start()
    try:
        started.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the shells start their children, true exits
            found, whole = _both(tree.pid)
            zombies = [c for p in found for c in budget._children(p) if budget._zombie(c)]
            if len(found) == 3 and zombies and sorted(found) == sorted(whole):
                break  # (the two reads are a moment apart: a shell may start a child between)
            time.sleep(0.05)
        assert sorted(found) == sorted(whole)
        assert len(found) == 3  # sleep (the zombie's parent), sh and its sleep
        assert zombies and not set(zombies) & set(found)
        mine, mine_whole = _both(os.getpid())
        assert tree.pid in mine and from_thread[0].pid in mine
        assert tree.pid in mine_whole and from_thread[0].pid in mine_whole
        assert all(mine.index(tree.pid) < mine.index(p) for p in found)  # parents first
    finally:
        done.set()
        t.join()
        for p in budget.descendants(tree.pid):
            os.kill(p, 9)
        for p in (tree, *from_thread):
            p.kill()
            p.wait()
