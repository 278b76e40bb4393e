"""How the suite runs: `make test` runs every test, `make test-fast` all but the slow
ones (tests/conftest.py SLOW), and every run prints its slowest tests."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# tests/conftest.py by its path: other folders have a conftest.py of their own
_spec = importlib.util.spec_from_file_location("qlab_tests_conftest", REPO / "tests/conftest.py")
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
SLOW = _conftest.SLOW


def test_every_slow_entry_names_a_test_that_exists():
    """A renamed or deleted test must leave SLOW too, or test-fast would silently grow."""
    for entry in SLOW:
        path, _, name = entry.partition("::")
        assert (REPO / path).is_file(), f"SLOW names {path}, which does not exist"
        if name:
            source = (REPO / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{path} has no test {name}"


def test_make_test_runs_everything_and_test_fast_leaves_out_the_slow_tests():
    make = (REPO / "Makefile").read_text()
    test = re.search(r"^test: setup llamacpp\n\t(.+)$", make, re.M).group(1)
    fast = re.search(r"^test-fast: setup\n\t(.+)$", make, re.M).group(1)
    # no -m, no -k; the llama.cpp tests must run (they fail, not skip, without llama.cpp)
    assert test == "QLAB_LLAMACPP=require $(BIN)/python -m pytest tests solutions $(PYTEST_NB)"
    assert fast.endswith('pytest tests -m "not slow"')


def test_every_run_prints_its_slowest_tests_and_slow_is_registered():
    pyproject = (REPO / "pyproject.toml").read_text()  # tomllib needs Python 3.11
    section = pyproject[pyproject.index("[tool.pytest.ini_options]") :].split("\n[", 1)[0]
    addopts = re.search(r'^addopts = "(.*)"$', section, re.M).group(1)
    assert "--durations=15" in addopts.split()
    assert re.search(r'^markers = \["slow: ', section, re.M)


def test_modules_graded_in_the_background_run_last():
    """A module with CLASS_RUN (grading_bank.ClassRun) goes after every other test, so
    that its class is graded beside them; the others keep their order."""
    from types import SimpleNamespace as NS

    run = object()
    items = [NS(nodeid="a", module=NS(CLASS_RUN=run)), NS(nodeid="b", module=NS()), NS(nodeid="c")]
    _conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["b", "c", "a"]


def test_chapters_then_the_site_then_class_runs_go_last():
    """The chapter tests wait for the background execution, the site's browser test builds
    from the executed chapters, and the class runs' tests wait for theirs."""
    from types import SimpleNamespace as NS

    chapter = _conftest.CHAPTER_TEST + "[00_x]"
    mark = lambda marker: None  # both are slow tests
    items = [
        NS(nodeid="tests/site/test_site_browser.py::test_pages", module=NS(), add_marker=mark),
        NS(nodeid="g", module=NS(CLASS_RUN=object())),
        NS(nodeid=chapter, module=NS(), callspec=NS(params={"path": Path("0")}), add_marker=mark),
        NS(nodeid="b", module=NS()),
    ]
    _conftest.pytest_collection_modifyitems(None, items)
    site = "tests/site/test_site_browser.py::test_pages"
    assert [i.nodeid for i in items] == ["b", chapter, site, "g"]


def test_the_chapter_run_executes_in_the_background_and_reports_failures(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "qlab_test_chapters", REPO / "tests/notebooks/test_chapters.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    build = module.site_build
    calls = []

    def execute(path, threads=None):  # a stand-in for a kernel: the test is about the run
        calls.append((path.name, threads))
        if path.name == "bad.ipynb":
            raise build.BuildError("chapter bad failed to execute (cell 3)")
        return {"executed": path.name}

    monkeypatch.setattr(build, "execute", execute)
    run = module.ChapterRun()
    good, bad, late = Path("good.ipynb"), Path("bad.ipynb"), Path("late.ipynb")
    run.start([good, bad], jobs=2, threads=1)
    run.start([good], jobs=1, threads=1)  # started once only
    assert run.result(good) == {"executed": "good.ipynb"}
    try:
        run.result(bad)
        raise AssertionError("a failed chapter must raise")
    except build.BuildError as e:
        assert "cell 3" in str(e)
    assert run.result(late) == {"executed": "late.ipynb"}  # not started: executed on demand
    run.wait()
    assert sorted(calls) == [("bad.ipynb", 1), ("good.ipynb", 1), ("late.ipynb", None)]
    assert set(run.seconds) == {good, bad, late}
