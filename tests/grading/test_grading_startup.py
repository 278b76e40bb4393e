"""What `qlab grade` pays before it grades anything, kept cheap without checking less: nbformat
imported without jsonschema's rfc3987_syntax (qlab/grading/_nbformat.py), a sandbox probe
that loads torch's libraries instead of importing torch (sandbox._PROBE), and a budget
supervisor that reads the submission's process tree from the root (budget.descendants)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from qlab.grading import budget, sandbox


def test_the_grader_imports_nbformat_without_rfc3987_syntax_and_leaves_it_importable():
    code = (
        "import sys\nimport qlab.grading.grader, qlab.grading.session\n"
        "print('rfc3987_syntax' in sys.modules, 'lark' in sys.modules)\n"
        "import nbformat, rfc3987_syntax\n"
        "nbformat.validate(nbformat.v4.new_notebook())\nprint('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "ok"]


def _probe(tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    argv = sandbox.bwrap_argv([str(tmp_path)], [], {"HOME": str(tmp_path), **env}, str(tmp_path))
    return subprocess.run(
        [*argv, "--", sandbox.PYTHON, "-c", sandbox._PROBE],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_sandbox_probe_loads_torch_s_libraries_and_imports_torch_only_if_that_fails(
    tmp_path,
):
    if sandbox.resolve("auto").level != sandbox.BWRAP:  # CI installs bubblewrap
        pytest.fail("bubblewrap must work here (make system-deps)")
    assert _probe(tmp_path, {}).returncode == 0
    # torch whose extension module is not a library: the probe imports torch instead,
    # which fails here (a library missing in the sandbox) or works (torch's own loader
    # finds what the linker does not)
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"not a shared library")
    env = {"PYTHONPATH": str(tmp_path / "fake")}
    (fake / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open')")
    done = _probe(tmp_path, env)
    assert done.returncode != 0 and "libtorch_cpu.so" in done.stderr, done.stderr[-2000:]
    (fake / "__init__.py").write_text("")
    assert _probe(tmp_path, env).returncode == 0


def _whole_proc_descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in budget._ppids().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


@pytest.mark.parametrize("children_files", [True, False], ids=["children-files", "whole-proc"])
def test_the_supervisor_finds_the_tree_that_the_whole_proc_shows(monkeypatch, children_files):
    assert budget._CHILDREN_FILES  # Linux with CONFIG_PROC_CHILDREN, as on the course machine
    monkeypatch.setattr(budget, "_CHILDREN_FILES", children_files)  # False: the fallback
    # three deep, with a zombie (`true`, never reaped: its parent exec'd sleep) left out
    tree = subprocess.Popen(
        ["sh", "-c", "sh -c 'true & exec sleep 30' & sh -c 'sleep 30 & wait' & wait"]
    )
    # a child of a thread that is not the main one, listed in that thread's children file
    # while the thread lives (Linux gives an exited thread's children to the main thread)
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
            found = budget.descendants(tree.pid)
            if len(found) == 3 and any(map(budget._zombie, _children_of(found))):
                break
            time.sleep(0.05)
        assert sorted(found) == sorted(_whole_proc_descendants(tree.pid))
        assert len(found) == 3  # sleep (the zombie's parent), sh and its sleep
        zombies = [p for p in _children_of(found) if budget._zombie(p)]
        assert zombies and not set(zombies) & set(found)
        mine = budget.descendants(os.getpid())
        assert tree.pid in mine and from_thread[0].pid in mine
        assert all(mine.index(tree.pid) < mine.index(p) for p in found)  # parents first
    finally:
        done.set()
        t.join()
        for p in budget.descendants(tree.pid):
            os.kill(p, 9)
        for p in (tree, *from_thread):
            p.kill()
            p.wait()


def _children_of(pids: list[int]) -> list[int]:
    return [c for p in pids for c in budget._children(p)]
