"""The harness the class-run tests share (grading_bank.ClassRun), where it can break."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# In a child process, so that its churn of the environment does not reach the threads of
# this one (a plain `pytest` runs the chapters and class runs beside the tests).
CHURN = """
import os, shutil, sys, time
sys.path.insert(0, sys.argv[1])
from grading_bank import ClassRun

starts = 200
run = ClassRun(
    write=lambda folder: (folder, None),
    commands=lambda subs, out, jobs: [[[shutil.which("true") or "/bin/true"]]] * starts,
)
try:
    run.start(jobs=1)
    deadline, changes = time.monotonic() + 120, 0
    while not run.done.is_set() and time.monotonic() < deadline:
        os.environ["QLAB_TEST_CHURN"] = str(changes)  # setenv, then unsetenv, as pytest does
        del os.environ["QLAB_TEST_CHURN"]
        changes += 1
    print(run.done.is_set(), repr(run.error), run.returncode, changes > starts)
finally:
    run.stop()
"""


def test_a_class_run_starts_its_commands_while_the_environment_changes():
    # pytest sets and removes PYTEST_CURRENT_TEST around every test while a class run
    # starts processes from its own thread. Started without an explicit environment, a
    # child (vfork) execs with the C `environ` that the main thread changes meanwhile:
    # OSError(14, 'Bad address') in CI. Measured: this test failed with that error
    # without the fix; a standalone loop of the same kind failed 302 of 1323 starts.
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", CHURN, here], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # finished in time, no error, every `true` exited 0, more than one change per start
    assert out.stdout.split() == ["True", "None", "0", "True"], (out.stdout, out.stderr[-3000:])
