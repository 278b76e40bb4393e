"""The harness the class-run tests share (grading_bank.ClassRun), where it can break."""

from __future__ import annotations

import os
import shutil
import time

from grading_bank import ClassRun


def test_a_class_run_starts_its_commands_while_the_tests_change_the_environment(tmp_path):
    # pytest sets and removes PYTEST_CURRENT_TEST around every test while a class run
    # starts processes from its own thread. Started without an explicit environment, a
    # child (vfork) execs with the C `environ` that the main thread changes meanwhile:
    # OSError(14, 'Bad address') in CI. Measured: this test failed with that error
    # without the fix; a standalone loop of the same kind failed 302 of 1323 starts.
    starts = 200
    run = ClassRun(
        write=lambda folder: (folder, None),
        commands=lambda subs, out, jobs: [[[shutil.which("true")]]] * starts,
    )
    name = "QLAB_TEST_CHURN"
    try:
        run.start(jobs=1)
        deadline = time.monotonic() + 120
        changes = 0
        while not run.done.is_set() and time.monotonic() < deadline:
            os.environ[name] = str(changes)  # setenv, then unsetenv, as pytest does
            del os.environ[name]
            changes += 1
        assert run.done.is_set(), f"{starts} starts of `true` took over 120 s"
        assert run.error is None and run.returncode == 0, (run.error, run.returncode)
        assert changes > starts  # on average, more than one change per start
    finally:
        os.environ.pop(name, None)
        run.stop()
