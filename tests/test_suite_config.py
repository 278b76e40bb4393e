"""How the suite runs: `make test` runs every test, `make test-fast` all but the slow
ones (tests/conftest.py SLOW), and every run prints its slowest tests."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

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


def test_every_early_entry_names_a_file_or_folder_that_exists():
    """A renamed file's EARLY entry must follow it, or the file would silently lose its early
    place (handed out in collection order)."""
    for entry in _conftest.EARLY:
        assert (REPO / entry).exists(), f"EARLY names {entry}, which does not exist"


def test_make_test_runs_everything_and_test_fast_leaves_out_the_slow_tests():
    make = (REPO / "Makefile").read_text()
    test = re.search(r"^test: setup llamacpp\n\t(.+)$", make, re.M).group(1)
    fast = re.search(r"^test-fast: setup\n\t(.+)$", make, re.M).group(1)
    # no -m, no -k; the llama.cpp tests must run (they fail, not skip, without llama.cpp)
    assert test == (
        "QLAB_LLAMACPP=require $(BIN)/python -m pytest $(PYTEST_N) tests solutions $(PYTEST_NB)"
    )
    assert fast.endswith('pytest $(PYTEST_N) tests -m "not slow"')
    # every usable CPU, a unit of work whole to one worker, in tests/conftest.py's order
    assert re.search(r"^PYTEST_N := (.+)$", make, re.M).group(1) == "-n auto"


def test_every_run_prints_its_slowest_tests_and_slow_is_registered():
    pyproject = (REPO / "pyproject.toml").read_text()  # tomllib needs Python 3.11
    section = pyproject[pyproject.index("[tool.pytest.ini_options]") :].split("\n[", 1)[0]
    addopts = re.search(r'^addopts = "(.*)"$', section, re.M).group(1)
    assert "--durations=15" in addopts.split()
    assert re.search(r'^markers = \["slow: ', section, re.M)


def test_modules_graded_in_the_background_run_last(monkeypatch):
    """A module with CLASS_RUN (grading_bank.ClassRun) goes after every other test, so
    that its class is graded beside them; the others keep their order."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(_conftest, "WORKER", None)  # one process, as a plain `pytest` runs

    run = object()
    items = [NS(nodeid="a", module=NS(CLASS_RUN=run)), NS(nodeid="b", module=NS()), NS(nodeid="c")]
    _conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["b", "c", "a"]


def test_chapters_then_the_site_then_class_runs_go_last(monkeypatch):
    """The chapter tests wait for the background execution, the site's browser test builds
    from the executed chapters, and the class runs' tests wait for theirs."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(_conftest, "WORKER", None)

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

    def execute(path, threads=None, environ=None):  # a stand-in for a kernel: the run is tested
        assert environ is run.environ  # the copy taken when the run was made
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


def test_under_pytest_n_what_waits_for_the_background_is_the_first_unit(monkeypatch):
    """A worker gets a unit of work whole: first the tests that wait for the background (the
    chapters, the site's browser test, the modules that grade a class: their first test
    starts it all), then each test file (module fixtures once, a notebook's cells in order)."""
    from types import SimpleNamespace as NS

    from xdist.scheduler import LoadScopeScheduling

    monkeypatch.setattr(_conftest, "WORKER", "gw0")
    chapter = _conftest.CHAPTER_TEST + "[00_x]"
    site = "tests/site/test_site_browser.py::test_pages"
    graded = "tests/grading/test_grading_mutants.py::test_feedback_is_precise"
    ids = ["tests/test_kv.py::t1", graded, site, "solutions/01.ipynb::Cell 0", chapter,
           "tests/test_kv.py::t2"]
    items = [NS(nodeid=i, module=NS(CLASS_RUN=object()) if i == graded else NS(),
                callspec=NS(params={"path": Path("0")}), add_marker=lambda mark: None)
             for i in ids]
    _conftest.pytest_collection_modifyitems(None, items)
    # then the EARLY units (the solutions here), then the other files in collection order
    assert [i.nodeid for i in items] == [chapter, site, graded, "solutions/01.ipynb::Cell 0",
                                         "tests/test_kv.py::t1", "tests/test_kv.py::t2"]
    assert [_conftest._hand_out(u) for u in ("background", "solutions/01.ipynb",
            "tests/test_readme_commands.py", "tests/test_kv.py")] == [0, 1, 1, 2]  # fmt: skip
    assert {_conftest._unit(i) for i in (chapter, site, graded)} == {"background"}
    assert _conftest._unit("tests/test_kv.py::t2") == "tests/test_kv.py"
    assert _conftest._unit("solutions/01.ipynb::Cell 0") == "solutions/01.ipynb"
    # a module whose CLASS_RUN its file does not show (as `CLASS_RUN = ...`) is refused
    odd = NS(nodeid="tests/test_kv.py::t3", module=NS(CLASS_RUN=object()),
             add_marker=lambda mark: None)
    with pytest.raises(pytest.UsageError, match="CLASS_RUN"):
        _conftest.pytest_collection_modifyitems(None, [odd])
    config = NS(option=NS(loadscopereorder=True), getvalue={"tx": ["2*popen"]}.get)
    sched = _conftest.pytest_xdist_make_scheduler(config, None)
    assert isinstance(sched, LoadScopeScheduling) and not config.option.loadscopereorder
    assert sched._split_scope(chapter) == "background"
    assert sched._split_scope("tests/test_kv.py::t1") == "tests/test_kv.py"
    assert _conftest.pytest_xdist_auto_num_workers(None) >= 1
    # the unit's first test starts the background (once: _start_background's own guard)
    started = []
    monkeypatch.setattr(_conftest, "_start_background", started.append)
    session = NS()
    for it in items:
        it.session = session
        _conftest.pytest_runtest_setup(it)
    assert started == [session] * 3
