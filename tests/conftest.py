"""Fixtures shared across test folders, and the course's thread policy for the tests.

The policy (qlab/_tensor.py): OpenMP threads that wait sleep instead of spinning
(OMP_WAIT_POLICY=PASSIVE, read once when torch loads OpenMP, so it is set here, before
any test module imports torch; kernels and subprocesses the tests start inherit it), and
torch uses the CPUs this process may use (`import qlab` applies it; under pytest -n,
each worker its share, below). A value the user set in the environment wins.
"""

import functools
import os
import re
import threading

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
# Under pytest -n N the N workers share the CPUs: each gets usable / N torch threads (at
# least 1), in its tests and in what they start that follows the policy (grading kernels
# take 1 thread anyway; the chapter run sets its own, below). While every worker
# is busy, more threads than cores add only synchronisation: measured on two cores,
# tests/lm, ptq, qat, test_kv.py and test_widgets.py under -n 2 took 6 % less CPU (and
# 4 % less time) on one thread per worker than on two. The price: a worker cannot use the
# cores that the others leave idle at the end of a run.
ALL_THREADS = None  # the policy's threads before that split (None: not split)
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("OMP_NUM_THREADS"):
    import torch  # noqa: E402

    from qlab._tensor import thread_count, usable_cpus  # noqa: E402

    ALL_THREADS = thread_count()
    _threads = max(1, usable_cpus() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # children, and qlab's thread_count()
    torch.set_num_threads(_threads)  # torch read the environment when it was imported

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _same_random_state():
    """Every test function starts from torch's global random state seeded with 0, whatever
    ran before it in its worker (module and session fixtures run before the seed; none of
    them calls torch's random functions directly without a generator): a test that draws
    with torch.randn and no generator gets the same inputs under `make test`,
    `make test-fast` and alone. (Unseeded, such inputs depended on the tests before: the
    AWQ salient-channel test, which now has its own generator, failed in one order of
    `make test-fast`.) nbval's notebooks in solutions/ run in their own kernels and are
    not affected."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(scope="session")
def executed_chapters(tmp_path_factory) -> Path:
    """Where tests/notebooks/test_chapters.py leaves each chapter it executed; the site's
    browser test builds from these instead of executing every chapter a second time."""
    path = tmp_path_factory.getbasetemp() / "executed-chapters"
    path.mkdir(exist_ok=True)
    return path


# Tests `make test-fast` leaves out: marked `slow` here, in one place (pytest node-id
# prefixes, relative to the repository), so the fast subset needs no edit in the test
# files. Each runs a notebook, a kernel, a browser, a clean clone, a build, a training
# run or a whole model: seconds to minutes each on the course's 2-core machine (pytest's
# --durations lists them at the end of `make test`). `make test` runs them all.
SLOW = (
    "tests/notebooks/test_chapters.py::test_chapter_runs_top_to_bottom",  # every chapter
    "tests/site/test_site_browser.py",  # the site's Sphinx build, read in Chromium
    "tests/notebooks/test_browser.py",  # JupyterLab driven in Chromium
    "tests/test_readme_commands.py::test_doc_commands_run_in_a_clean_clone",  # `qlab grade`
    "tests/test_readme_commands.py::test_my_work_is_a_safe_workspace",  # a clean clone
    "tests/lm/test_checkpoint.py::test_validation_perplexity_matches_documented_value",
    "tests/ptq/test_calibrate.py::test_end_to_end_through_the_w4a16_kernel",  # interpreter
    "tests/ptq/test_calibrate.py::test_shipped_results_are_reproduced",
    "tests/ptq/test_calibrate.py::test_shipped_minilm_gptq_row_is_reproduced",
    "tests/ptq/test_gptq.py::test_benchmark_script_runs",
    "tests/qat/test_modules.py::test_a_short_qat_run_lowers_the_loss_of_the_quantized_model",
    "tests/qat/test_train.py::test_the_script_reproduces_the_first_logged_losses",
    "tests/qat/test_train.py::test_cli_writes_a_checkpoint_and_a_log",
    "tests/qat/test_train.py::test_shipped_qat_beats_ptq_at_the_same_bits",
    "tests/qat/test_baselines.py::test_the_script_reproduces_a_shipped_baseline",
    "tests/gguf/test_gguf_file.py::test_tinylm_round_trip_bit_exact",
    "tests/gguf/test_gguf_imatrix.py::test_imatrix_lowers_the_error_it_weights",
    # llama.cpp's own tools and runtime on real GGUF files (15-55 s each on 2 busy cores)
    "tests/gguf/test_gguf_llamacpp_export.py",
    "tests/gguf/test_gguf_llamacpp_quantize.py",
    "tests/gguf/test_gguf_llamacpp_runtime.py",
    "tests/gguf/test_gguf_llamacpp_tinylm.py",
    # `qlab grade` end to end: sandboxed kernels execute whole notebooks
    "tests/grading/test_grading_mutants.py",
    "tests/grading/test_grading_wall_clock.py",
    "tests/grading/test_grading_sandbox.py",
    "tests/grading/test_grading_cli.py",
    "tests/grading/test_grading_hostile.py",
    "tests/grading/test_grading_part3.py",
    "tests/grading/test_grading_harness.py",  # 200 process starts while the environment changes
    "tests/kernels/test_kernel_exercises.py",
    # the check() bank on many seeds, kernels on the interpreter, ahead-of-time builds,
    # subprocesses that import torch and triton afresh
    "tests/grading/test_grading_check.py::test_mutant_fails_on_every_seed",
    "tests/grading/test_grading_guard.py::test_the_size_limit_does_not_import_torch_dynamo_and_holds_with_it",
    "tests/grading/test_grading_check.py::test_solution_passes_on_many_seeds",
    "tests/kernels/test_kernel_aot.py",
    "tests/kernels/test_exercise_kernels_aot.py",
    "tests/kernels/test_kernel_backend.py",
    "tests/kernels/test_bench.py::test_cpu_mode_checks_every_candidate_and_writes_a_labelled_model",
    "tests/kernels/test_gpu_session.py::test_a_shape_whose_process_dies_is_recorded_and_the_next_shape_runs",
    "tests/kernels/test_kernel_safety.py::test_a_128k_vocabulary_lm_head_at_16k_tokens_builds_with_64_bit_offsets",
    "tests/kernels/test_w4a16_decode.py::test_decode_gemv_sass_is_under_4_instructions_per_weight_byte",
    "tests/kernels/test_w4a16_decode.py::test_decode_gemv_uses_64_bit_offsets_past_2_gb_of_words",
    "tests/lm/test_ch12_results.py::test_shipped_rows_match_a_fresh_computation",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    # what runs in the background goes last, to wait for it: the chapters (below), then the
    # site's browser test that builds from them, then the modules whose class of
    # submissions is graded in the background (the tests keep their order otherwise)
    items.sort(key=_place)
    if WORKER:  # pytest -n: what waits for the background first (see _unit)
        for item in items:  # the controller finds class runs by file: it must agree
            path = item.nodeid.split("::")[0]
            if (_class_run(item) is not None) != _grades_a_class(path):
                raise pytest.UsageError(f"{path}: define CLASS_RUN as `CLASS_RUN = ...`")
        items.sort(key=lambda item: _hand_out(_unit(item.nodeid)))


# `make test` runs the suite in one worker per usable CPU (pytest-xdist, -n auto). A unit
# of work goes to one worker whole (Units below): each test file is one (its module
# fixtures computed once, a notebook's cells in order), except the tests that wait for
# what runs in the background (the chapters, the site's browser test that builds from
# them, the modules that grade a class), which are one unit together, handed out first
# and started by its first test (pytest_runtest_setup): while that worker's background
# kernels and class runs work, the other workers take the test files: EARLY first (below),
# then in collection order.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # this process is a worker of `pytest -n`
# Units handed out right after the background one (prefixes of their files): two wait much
# of their time (JupyterLab and its page in Chromium; a kernel that sleeps to its wall-clock
# limit), the doc commands in a clean clone take 45 s, and each solution under nbval starts
# a kernel. Early, they run while the background's kernels can use the CPU they leave, and
# the run ends on short units of in-process tests, so the workers finish close together.
EARLY = (
    "tests/notebooks/test_browser.py",
    "tests/grading/test_grading_wall_clock.py",
    "tests/test_readme_commands.py",
    "solutions/",
)
BACKGROUND = "background"  # the unit of the tests that wait for the background
ROOT = Path(__file__).resolve().parents[1]  # node ids are relative to it


def _hand_out(unit: str) -> int:
    """Where a unit goes in the order units are handed out: background, EARLY, the rest."""
    return 0 if unit == BACKGROUND else 1 if unit.startswith(EARLY) else 2


def _unit(nodeid: str) -> str:
    """The unit of work of a test under pytest -n: BACKGROUND or its file."""
    path = nodeid.split("::")[0]
    if nodeid.startswith((CHAPTER_TEST, SITE_BROWSER)) or _grades_a_class(path):
        return BACKGROUND
    return path


@functools.cache
def _grades_a_class(path: str) -> bool:
    """A test module that defines CLASS_RUN (tests/grading/grading_bank.py ClassRun)."""
    file = ROOT / path
    return file.suffix == ".py" and re.search(r"^CLASS_RUN = ", file.read_text(), re.M) is not None


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist runs without these two
def pytest_xdist_make_scheduler(config, log):
    """Units of work as _unit says, in collection order (pytest-xdist's --dist loadgroup
    cannot group with pytest 9's node ids)."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # keep the order: the background unit first
    return Units(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """-n auto: the CPUs this process may use (affinity and cgroup quota), qlab's rule."""
    from qlab._tensor import usable_cpus

    return usable_cpus()


def pytest_runtest_setup(item):
    if WORKER and _unit(item.nodeid) == BACKGROUND:
        _start_background(item.session)


def _place(item) -> int:
    if _chapter_path(item) is not None:
        return 1
    if item.nodeid.startswith(SITE_BROWSER):
        return 2
    return 3 if _class_run(item) is not None else 0


# tests/notebooks/test_chapters.py executes every chapter in the background (CHAPTER_RUN),
# started once the session's tests are collected: one kernel at a time with one torch
# thread beside the other tests (mostly single-threaded: the second core is otherwise
# idle), every usable CPU when only chapters are selected. The site's browser test builds
# from the executed chapters, so it runs after their tests.
_SUMMARY = pytest.StashKey[bool]()  # the chapter times were printed
CHAPTER_SECONDS = "chapter_seconds"  # the user property a chapter test records: (name, s)
CHAPTER_TEST = "tests/notebooks/test_chapters.py::test_chapter_runs_top_to_bottom"
SITE_BROWSER = "tests/site/test_site_browser.py"


def _chapter_path(item):
    if not item.nodeid.startswith(CHAPTER_TEST):
        return None
    return getattr(item, "callspec", None) and item.callspec.params["path"]


def _start_chapter_run(session) -> None:
    paths = [p for p in map(_chapter_path, session.items) if p is not None]
    if not paths:
        return
    from qlab._tensor import thread_count, usable_cpus

    run = next(i for i in session.items if _chapter_path(i) is not None).module.CHAPTER_RUN
    if len(paths) < len(session.items):  # beside other tests
        run.start(paths, jobs=1, threads=1)
    else:
        jobs = min(len(paths), usable_cpus())  # the other workers have nothing to do
        run.start(paths, jobs=jobs, threads=max(1, (ALL_THREADS or thread_count()) // jobs))


# A test module with CLASS_RUN (tests/grading/grading_bank.py ClassRun: a `qlab grade` run
# of a class of submissions in a child process) gets it started once the session's tests
# are collected, one run at a time, and its tests are moved to the end (above): the runs
# grade on the cores that the mostly single-threaded tests before them leave free (--jobs
# = usable CPUs - 1; all of them when no other test is selected), and the fixture that
# reads a run's grades waits for it. Only modules whose selected tests use the `graded`
# fixture start theirs.
_RUNS = pytest.StashKey[list]()  # the runs this session started


def _class_run(item):
    return getattr(getattr(item, "module", None), "CLASS_RUN", None)


def pytest_collection_finish(session):
    if not session.config.option.collectonly and not WORKER:
        _start_background(session)


def _start_background(session) -> None:
    """The chapter run and the class runs, once per session."""
    if session.config.stash.get(_RUNS, None) is not None:
        return
    session.config.stash[_RUNS] = []
    _start_chapter_run(session)
    runs = []
    for item in session.items:
        run = _class_run(item)
        if run is not None and "graded" in getattr(item, "fixturenames", ()) and run not in runs:
            runs.append(run)
    session.config.stash[_RUNS] = runs
    if not runs:
        return
    from qlab._tensor import usable_cpus

    others = any(_class_run(item) is None for item in session.items)
    jobs = max(1, usable_cpus() - 1) if others else usable_cpus()

    def one_at_a_time() -> None:
        for run in runs:
            run.start(jobs)
            run.done.wait()

    threading.Thread(target=one_at_a_time, daemon=True).start()


def pytest_unconfigure(config):
    for run in config.stash.get(_RUNS, []):
        run.stop()


def pytest_terminal_summary(terminalreporter, config):
    """Each chapter's own execution time (its test records it; --durations shows how long
    the test waited), from this process or from the workers of pytest -n."""
    if config.stash.get(_SUMMARY, False):
        return  # (the hook can be called twice in one session: print once)
    seconds = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == CHAPTER_SECONDS:
                    seconds[report.nodeid] = value
    if not seconds:
        return
    config.stash[_SUMMARY] = True
    terminalreporter.section("chapters executed in the background, slowest first")
    for name, value in sorted(seconds.values(), key=lambda nv: -nv[1]):
        terminalreporter.write_line(f"{value:7.1f}s  {name}")
