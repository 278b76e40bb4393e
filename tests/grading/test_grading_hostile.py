"""Issue 24: no credit the work did not earn, and no submission that can stop or poison a class.

A class of 40 notebooks is graded ONCE (in the background from the start of the session:
grading_bank.ClassRun), the way a careless instructor would start it: `python -m qlab.cli
grade` from the repository root with PYTHONPATH pointing at it and `python` found through
a relative PATH entry (`PATH=.venv/bin:$PATH`, which makes sys.executable relative),
`--jobs 2`, `--sandbox auto` (which must still choose bwrap),
`--forbid-reference`, and a small budget per submission (2 GB of memory, 64 processes and
threads, 256 MB of files). The class holds honest students (alice and 28 more of
01_affine, the cheapest exercise; bob's solved 12_outliers, where a size limit is checked)
and one hostile submission of each kind:

- borrower: the blank exercise plus the cell that binds every graded name to the
  registry's reference;
- forger: `symmetric_quantize` calls `qlab.quantize`; `asymmetric_quantize` looks for
  solutions/ and .git (the grader was started from the checkout) and fills its disk;
  `affine_dequantize`'s result is rewritten on the wire to a float that overflows;
- forker: forks children that allocate 512 MB each; spawner: starts 96 processes;
- file names: non-UTF-8 bytes, the same name in a/ and b/a/, a name that a spreadsheet
  would run as a formula, a byte-identical pair, a link to another student's notebook and
  a link to a host file;
- matrix builder (12_outliers): `fwht` forms the n x n matrix the spec forbids (right
  values: only the task's size limit fails it; tests/grading/test_grading_guard.py).
Every honest submission must keep its full marks.
"""

from __future__ import annotations

import copy
import csv
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from grading_bank import ClassRun
from test_grading_guard import MATRIX_FWHT

from qlab.grading import CheckFailed, check, get_task, sandbox
from qlab.grading.registry import evaluate, make_cases
from qlab.grading.similarity import normalise, pairs

ROOT = Path(__file__).resolve().parents[2]
FULL = 5
HONEST = 28  # besides alice and bob: with the 10 other entries, a class of 40
MAXES = {"matrix_12_outliers": 8, "bob_12_outliers": 8}  # 12_outliers (else FULL: 01_affine)
# --procs 64: honest submissions peak at 13-16 processes and threads. The spawner must get
# past PROCS inside the room that the grading user's own limit (ulimit -u, or a cgroup's
# pids.max) leaves to all of the session's processes: CI (where such a limit applies) saw
# no breach with --procs 256 and 400 `sleep`s; on the development machine (Linux 6.18),
# running this module as a user other than root with ulimit -u 220, the spawner of 400
# under --procs 256 peaked at 178 with no breach; these sizes pass there.
MEM_MB, PROCS, DISK_MB = 2048, 64, 256
SPAWN = 96
SECRET = f"TOPSECRET-{os.getpid()}"
FORMULA = '=HYPERLINK("evil")_01_affine'
ODD = os.fsdecode(b"\xff\xfe_01_affine")  # as unzip leaves a Windows archive's name
BIND = """
import qlab.grading.registry as _r
for _t in _r.all_tasks().values():
    globals()[_t.func_name] = _t.reference
"""
CALLER = """
import qlab

def symmetric_quantize(x, bits):
    qt = qlab.quantize(x, qlab.int_scheme(bits))
    return qt.codes, qt.scales
"""
OVERFLOW = """
import json
_real_dumps = json.dumps

def _dumps(obj, *args, **kwargs):  # the harness's own json.dumps, rewritten
    return _real_dumps(obj, *args, **kwargs).replace("0x1.0000000000000p+0", "0x1p99999")

json.dumps = _dumps

def affine_dequantize(codes, scale, zero_point):
    return 1.0
"""
CHECKOUT = [str(ROOT / n) for n in ("solutions", ".git", "tests", "README.md")]
SNOOP_AND_FILL = f"""
import os
_SEEN = [p for p in {CHECKOUT!r} if os.path.exists(p)]

def asymmetric_quantize(x, bits):
    written = 0
    try:
        for i in range(8):  # 800 MB in files of 100 MB
            with open(os.path.join(os.environ["HOME"], f"fill{{i}}"), "wb") as f:
                for _ in range(100):
                    f.write(b"\\0" * 2**20)
                    written += 1
    except OSError as e:
        raise RuntimeError(f"visible: {{_SEEN}}; wrote {{written}} MB, then {{e.strerror}}")
    raise RuntimeError(f"visible: {{_SEEN}}; wrote {{written}} MB")
"""
FORGER = {
    "sym_quantize_solution": CALLER,
    "asym_quantize_solution": SNOOP_AND_FILL,
    "affine_dequantize_solution": OVERFLOW,
}
FORKER = """
import os, time
for _ in range(16):  # 8 GB if nothing stops it; each child within its own rlimit
    if os.fork() == 0:
        try:
            _x = b"\\1" * 2**29
            time.sleep(60)
        finally:
            os._exit(0)
time.sleep(15)
"""
SPAWNER = f"""
import subprocess
import time
try:
    _procs = [subprocess.Popen(["sleep", "60"]) for _ in range({SPAWN})]
finally:  # past the budget inside this cell, for many of the supervisor's samples
    time.sleep(5)
"""


def _nb(name: str, folder: str = "solutions") -> nbformat.NotebookNode:
    return nbformat.read(str(ROOT / folder / f"{name}.ipynb"), as_version=4)


def _edit(nb, replace: dict[str, str] | None = None, *extra: str, note: str = ""):
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if replace and gid in replace:
            cell.source = textwrap.dedent(replace[gid]).strip("\n")
    nb.cells += [nbformat.v4.new_code_cell(textwrap.dedent(s).strip("\n")) for s in extra]
    if note:  # a different file with the same code
        nb.cells.append(nbformat.v4.new_markdown_cell(note))
    return nb


def _class(base: Path) -> dict[str, int]:
    """Writes the class under base/subs; returns key -> expected total."""
    sol, blank = _nb("01_affine"), _nb("01_affine", "exercises")
    subs = base / "subs"
    (subs / "a").mkdir(parents=True)
    (subs / "b" / "a").mkdir(parents=True)
    books = {
        "alice_01_affine": (_edit(sol), FULL),
        FORMULA: (blank, 0),
        "borrower_01_affine": (_edit(blank, None, BIND), 0),
        "forger_01_affine": (_edit(sol, FORGER), 0),
        "forker_01_affine": (_edit(sol, None, FORKER), FULL),
        "spawner_01_affine": (_edit(sol, None, SPAWNER), FULL),
        f"a/{ODD}": (_edit(sol, note="a"), FULL),
        "bob_12_outliers": (_nb("12_outliers"), 8),
        "matrix_12_outliers": (_edit(_nb("12_outliers"), {"fwht_solution": MATRIX_FWHT}), 5),
    }
    for i in range(HONEST):  # distinct files (not duplicates), the same code
        books[f"student{i:02d}_01_affine"] = (_edit(sol, note=f"student {i}"), FULL)
    for name, (nb, _) in books.items():
        nbformat.write(nb, str(subs / f"{name}.ipynb"))
    copy_of_a = (subs / f"a/{ODD}.ipynb").read_bytes()
    (subs / f"b/a/{ODD}.ipynb").write_bytes(copy_of_a)  # byte for byte the same file
    (base / "secret.txt").write_text(SECRET)
    os.symlink(subs / "alice_01_affine.ipynb", subs / "linker_01_affine.ipynb")
    os.symlink(base / "secret.txt", subs / "hostlink_01_affine.ipynb")
    expected = {name: total for name, (_, total) in books.items()}
    expected[f"subs/a/{ODD}"] = expected.pop(f"a/{ODD}")  # key: the shortest unique path
    expected[f"b/a/{ODD}"] = FULL
    expected.update(linker_01_affine=0, hostlink_01_affine=0)
    return expected


def _key(name: str) -> str:
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _write(base: Path) -> tuple[Path, dict[str, int]]:
    expected = _class(base)
    return base / "subs", {_key(k): v for k, v in expected.items()}


def _commands(subs: Path, out: Path, jobs: int) -> list[list[list[str]]]:
    argv = [EXE.name, "-m", "qlab.cli", "grade", str(subs), "--out", str(out)]
    argv += ["--jobs", "2", "--sandbox", "auto", "--forbid-reference", "--seed", "25"]
    argv += ["--mem-mb", str(MEM_MB), "--procs", str(PROCS), "--disk-mb", str(DISK_MB)]
    argv += ["--timeout", "60", "--quiet"]
    return [[argv]]  # --jobs 2 as the instructor typed it, whatever `jobs` the session has


EXE = Path(sys.executable)
PATH = f"{os.path.relpath(EXE.parent, ROOT)}{os.pathsep}{os.environ['PATH']}"
# graded in the background from the start of the session (grading_bank.ClassRun), from a
# checkout by hand: cwd is the repository, `python` is found through a relative PATH entry
CLASS_RUN = ClassRun(
    write=_write,
    commands=_commands,
    limit_s=900,
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": str(ROOT), "PATH": PATH},
)


@pytest.fixture(scope="module")
def graded():
    if sandbox.resolve("auto").level != sandbox.BWRAP:  # CI installs bubblewrap
        pytest.fail("bubblewrap must work here (make system-deps)")
    run = CLASS_RUN.result()
    out = run["out"]
    doc = run["doc"]
    table = run["rows"]
    with open(out / "similarity.csv", newline="", encoding="utf-8") as f:
        similar = list(csv.DictReader(f))
    return {"rows": doc["submissions"], "table": table, "similar": similar, "out": out,
            "expected": run["written"]}


def _feedback(row) -> dict[str, str]:
    return {g: t["feedback"] for g, t in row["tasks"].items()}


def test_the_class_finishes_and_honest_marks_are_unchanged(graded):
    rows = graded["rows"]
    assert sorted(rows) == sorted(graded["expected"])
    assert len(rows) == 40
    for key, want in graded["expected"].items():
        row = rows[key]
        assert row["status"] == "graded", (key, row["log"])
        assert row["isolation"] == "bwrap", key  # a relative sys.executable kept the sandbox
        assert row["max"] == MAXES.get(key, FULL), key
        if key == "spawner_01_affine":  # should its `sleep 60` processes outlive the
            # kill of the cell that started them, they cost its first task (a breach
            # measured there): only its own points, and said so
            lost = [t for t in row["tasks"].values() if t["score"] < t["max"]]
            assert all("went over its budget" in t["feedback"] for t in lost), row
            continue
        assert row["total"] == want, (key, _feedback(row), row["log"])


def test_a_forbidden_matrix_costs_only_its_task(graded):
    tasks = graded["rows"]["matrix_12_outliers"]["tasks"]
    assert tasks["fwht"]["score"] == 0 and "SizeLimit" in tasks["fwht"]["feedback"]
    assert "the spec forbids forming the n x n matrix" in tasks["fwht"]["feedback"]
    assert tasks["smooth_scales"]["score"] == 2 and tasks["llm_int8_matmul"]["score"] == 3


def test_borrowing_is_recorded_and_forbidden(graded):
    borrower = graded["rows"]["borrower_01_affine"]
    for gid, task in borrower["tasks"].items():
        assert task["uses_reference"], gid
        assert "--forbid-reference" in task["feedback"] and "passes only because" in task[
            "feedback"], task["feedback"]
    forger = graded["rows"]["forger_01_affine"]["tasks"]
    assert forger["sym_quantize"]["uses_reference"] == ["qlab.quantize"]
    assert "calls qlab.quantize; the exercise asks you to write it" in forger["sym_quantize"][
        "feedback"]
    assert forger["asym_quantize"]["uses_reference"] == []  # raised: nothing borrowed
    by = {r["submission"]: r for r in graded["table"]}
    assert by["borrower_01_affine"]["uses_reference"] == "sym_quantize asym_quantize " \
        "affine_dequantize"
    assert by["forger_01_affine"]["uses_reference"] == "sym_quantize"
    assert by["alice_01_affine"]["uses_reference"] == ""


def test_an_overflowing_result_fails_only_its_task(graded):
    fb = _feedback(graded["rows"]["forger_01_affine"])
    assert "could not read the result (OverflowError" in fb["affine_dequantize"]


def test_the_checkout_is_not_mounted_and_the_disk_quota_holds(graded):
    fb = _feedback(graded["rows"]["forger_01_affine"])
    assert "visible: [];" in fb["asym_quantize"]  # not solutions/, .git, tests/, README.md
    written = int(re.search(r"wrote (\d+) MB, then No space left", fb["asym_quantize"])[1])
    assert written <= DISK_MB


def test_fork_and_allocate_and_process_bombs_are_stopped(graded):
    rows = graded["rows"]
    forker, spawner = " ".join(rows["forker_01_affine"]["log"]), " ".join(
        rows["spawner_01_affine"]["log"])
    assert f"more than {MEM_MB} MB of memory together" in forker, forker
    # a fork refused by the user's own limit shows in the log as BlockingIOError
    why = (spawner, _feedback(rows["spawner_01_affine"]))
    assert f"more than {PROCS} processes and threads" in spawner, why
    threads = {k: int(re.findall(r"peak processes and threads: (\d+)", " ".join(r["log"]))[-1])
               for k, r in rows.items() if k.startswith(("spawner", "student"))}
    assert threads.pop("spawner_01_affine") > PROCS, spawner  # the peak line parses, holds it
    assert max(threads.values()) < PROCS // 2, threads  # honest kernels: far inside --procs
    peak = int(re.search(r"peak memory of its processes together: (\d+) MB", forker)[1])
    print(f"fork-and-allocate: peak {peak} MB of a {MEM_MB} MB budget (8 GB attempted)")
    assert peak < MEM_MB + 1536  # a measurement every 50 ms: at most ~1.5 children over


def test_file_names_links_and_duplicates(graded):
    rows, table = graded["rows"], graded["table"]
    keys = {r["submission"] for r in table}
    assert {f"subs/a/{_key(ODD)}", f"b/a/{_key(ODD)}"} <= keys  # both graded, none refused
    assert "'" + FORMULA in keys  # a spreadsheet shows it, it does not run it
    assert not any(v.startswith(("=", "+", "-", "@")) for r in table for v in r.values())
    for name in ("linker_01_affine", "hostlink_01_affine"):
        assert rows[name]["flags"][0].startswith("symlink:"), rows[name]
    assert SECRET not in (graded["out"] / "grades.json").read_text()
    odd = rows[f"b/a/{_key(ODD)}"]["flags"]
    assert odd == [f"duplicate: the same file as subs/a/{_key(ODD)}"], odd
    assert not any(f.startswith("duplicate") for f in rows["alice_01_affine"]["flags"])


def test_similarity_report_pairs_copies_not_the_template(graded):
    found = {frozenset((r["submission_a"], r["submission_b"])) for r in graded["similar"]}
    assert frozenset(("alice_01_affine", f"subs/a/{_key(ODD)}")) in found
    blank = {"'" + FORMULA, "borrower_01_affine"}  # the same stubs: only template
    assert not any(pair & blank for pair in found)  # the untouched template is no answer
    assert all(float(r["similarity"]) >= 0.8 for r in graded["similar"])


# --- without kernels --------------------------------------------------------------------


def test_check_says_the_function_calls_the_reference(capsys):
    namespace: dict = {}
    exec(textwrap.dedent(CALLER), namespace)
    with pytest.raises(CheckFailed, match="calls qlab.quantize; the exercise asks you to write"):
        check("sym_quantize", namespace["symmetric_quantize"], seed=1)
    with pytest.raises(CheckFailed, match="passes only because it calls"):
        check("asym_quantize", get_task("asym_quantize").reference, seed=1)


KV_CALLERS = """
import qlab
import qlab.kv

def kivi_keys(k, bits, chunk, window):  # right values: qlab.quantize on the transpose
    old = max(k.shape[0] - window, 0)
    end = -(-old // chunk) * chunk
    k_hat = k.clone()
    if end:
        qt = qlab.quantize(k[:end].T.contiguous(), f"uint{bits}_asym", chunk)
        k_hat[:end] = qt.dequantize().T
    k_hat[old:] = k[old:]
    return k_hat

def fp8_kv_cache(calib, x, per_head):  # qlab.kv's own scale and cache quantizer
    s = qlab.kv.fp8_static_scale(calib[None], "head" if per_head else "tensor")
    return s, qlab.formats.get("fp8_e4m3fn").encode(x / s), qlab.kv._fp8_static(x, s)
"""


def test_check_names_the_kv_cache_references(capsys):
    """Chapter 16: functions that compute the right values by calling qlab are named."""
    namespace: dict = {}
    exec(textwrap.dedent(KV_CALLERS), namespace)
    with pytest.raises(CheckFailed, match="kivi_keys passes only because it calls qlab.quantize"):
        check("kivi_keys", namespace["kivi_keys"], seed=2)
    with pytest.raises(CheckFailed, match="calls .*qlab.kv._fp8_static, qlab.kv.fp8_static_scale"):
        check("fp8_kv_cache", namespace["fp8_kv_cache"], seed=2)


def test_a_flag_without_forbid_keeps_the_points():
    task = get_task("bits_per_weight")
    cases = make_cases(task, 3)
    records = [{"ok": {"__float__": float(task.reference(*c)).hex()}, "borrowed": ["x"]}
               for c in cases]
    kept = evaluate(task, cases, records)
    assert kept.passed and kept.score == task.points and kept.uses_reference == ["x"]
    refused = evaluate(task, cases, records, forbid_reference=True)
    assert refused.score == 0 and "--forbid-reference" in refused.feedback


def test_normalising_ignores_names_comments_and_layout():
    a = "def f(x, n):\n    '''doc'''\n    y = torch.round(x / n)  # note\n    return y\n"
    b = "def g(  v,k ):\n    w = torch.round(v/k)\n\n    return w"
    assert normalise(a) == normalise(b)
    c = "def g(v, k):\n    w = torch.floor(v / k)\n    return w"
    assert normalise(a) != normalise(c)  # attribute names (the algorithm) are kept
    long = "\n".join(f"y{i} = torch.round(x * {i}) + y{i - 1}" for i in range(1, 8))
    assert pairs({"p": normalise(long), "q": normalise(long.replace("y", "z"))}) == [
        ("p", "q", 1.0)]
    assert pairs({"p": normalise(long), "q": normalise(long)}, set(normalise(long))) == []


def test_every_declared_reference_resolves():
    from qlab.grading import _harness, all_tasks

    for task in all_tasks().values():
        assert task.implements, f"{task.grade_id} declares no implements=(...)"
        for name in task.implements:
            assert callable(_harness._resolve(name)[2]), (task.grade_id, name)


def test_the_supervisor_kills_a_fork_and_allocate_tree():
    # The Supervisor watches every process below the one that runs it, so it runs in a child
    # process of its own: this test's process may have others below it (the chapters' kernels
    # and the class runs that tests/conftest.py starts), which it would count and kill too.
    script = textwrap.dedent('''
        import os, subprocess, sys
        from qlab.grading.budget import Budget, Supervisor, descendants

        # named with bytes that are not UTF-8 (prctl PR_SET_NAME; the children inherit it):
        # reading /proc/PID/status as text raised in the supervisor, which then stopped
        bomb = ("import ctypes, os, time\\n"
                "assert ctypes.CDLL(None).prctl(15, b'\\\\xff\\\\xfe', 0, 0, 0) == 0\\n"
                "assert open('/proc/self/comm', 'rb').read() == b'\\\\xff\\\\xfe\\\\n'\\n"
                "for _ in range(12):\\n    if os.fork() == 0:\\n"
                "        x = b'1' * 2**27\\n        time.sleep(30)\\n        os._exit(0)\\n"
                "time.sleep(30)")
        proc = subprocess.Popen([sys.executable, "-c", bomb])
        budget = Budget(mem_bytes=512 * 2**20, threads=10_000, disk_bytes=2**40)
        with Supervisor(budget) as sup:  # all below this process: 12 x 128 MB tried, 512 allowed
            proc.wait(timeout=30)
        assert proc.returncode == -9 and descendants(os.getpid()) == [], proc.returncode
        reason = sup.take_reason()
        assert "more than 512 MB" in reason, reason
        assert sup.peak_mem < 512 * 2**20 + 2 * 2**27, sup.peak_mem  # < 2 children over
    ''')
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_supervisor_reads_a_proc_file_to_its_end(tmp_path):
    """budget._read reads 64 KiB at a time until a read comes back short (nothing guarantees
    that a /proc file fits in one read), shown on ordinary files: one of several buffers comes
    back whole and in order (a single read would return its first 64 KiB), and one of exactly
    one buffer ends at the empty read that follows."""
    from qlab.grading.budget import _read

    for size in (4 * 2**16 + 123, 2**16):
        path = tmp_path / f"f{size}"
        path.write_bytes(os.urandom(size))
        assert _read(str(path)) == path.read_bytes(), size
    assert _read(str(tmp_path / "gone")) is None


def test_the_sandbox_nproc_backstop_is_twice_the_budget_and_at_least_512(tmp_path):
    from qlab.grading.session import GradeOptions, kernel_env

    def nproc(procs: int, isolation: str) -> str | None:
        opts = GradeOptions(procs=procs, isolation=isolation)
        return kernel_env(opts, tmp_path, []).get("QLAB_GRADER_NPROC")

    assert (nproc(64, sandbox.BWRAP), nproc(1000, sandbox.BWRAP)) == ("512", "2000")
    assert nproc(64, sandbox.NONE) is None  # without the sandbox it would count the user's


def test_the_launcher_keeps_each_limit_within_the_hard_limit(monkeypatch):
    from qlab.grading import _launch

    res, set_to = _launch.resource, []
    monkeypatch.setattr(res, "setrlimit", lambda which, limits: set_to.append(limits))
    for hard in (220, res.RLIM_INFINITY):
        monkeypatch.setattr(res, "getrlimit", lambda which, hard=hard: (100, hard))
        _launch._limit(res.RLIMIT_NPROC, 512)
    assert set_to == [(220, 220), (512, 512)]


def test_keys_for_any_name_and_formula_safe_cells():
    from qlab.grading.grader import submission_keys
    from qlab.grading.results import cell

    odd = Path(os.fsdecode(b"c/\xff.ipynb"))
    keys = submission_keys([Path("a/x.ipynb"), Path("b/a/x.ipynb"), odd, Path("y.ipynb")])
    assert keys == {"a/x": Path("a/x.ipynb"), "b/a/x": Path("b/a/x.ipynb"), "\\xff": odd,
                    "y": Path("y.ipynb")}
    assert [cell(v) for v in ("=1+1", "+1", "-1", "@x", "\tx", "ok", 3)] == [
        "'=1+1", "'+1", "'-1", "'@x", "'\tx", "ok", 3]
