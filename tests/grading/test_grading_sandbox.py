"""`qlab grade` against a hostile class: sandbox, dead workers, result limits, shards.

One class of submissions is graded ONCE per module, as a batch system would: two
`qlab grade --shard I/2` processes at the same time (sandbox required), then `qlab grade
merge`, in the background from the start of the session (grading_bank.ClassRun). The
class holds attackers (a result-forging daemon, a kernel killer, a parent killer, a
notebook that looks for the other students' notebooks to copy them, a student who silences
stdout, file-name/metadata mismatches) and correct victims. Separate, small
runs cover a dead worker without a sandbox (--jobs 1 and 2), oversized and deeply nested
results (with the grader's own peak memory), and the pieces without kernels.
"""

from __future__ import annotations

import copy
import csv
import functools
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from grading_bank import ClassRun

from qlab.cli import main
from qlab.grading import sandbox
from qlab.grading.grader import GradeOptions, grade_many, merge, submission_keys
from qlab.grading.results import SubmissionRow, load_results, merge_results, write_results

ROOT = Path(__file__).resolve().parents[2]
SEED = 424242
MARK = f"QLAB_FORGER_{os.getpid()}"  # in the forging daemon's command line
ASSIGNMENT = "01_affine"  # small and fast: three tasks, 5 points
FULL = 5


def _solution(name: str = ASSIGNMENT) -> nbformat.NotebookNode:
    return nbformat.read(str(ROOT / "solutions" / f"{name}.ipynb"), as_version=4)


def _with(nb, *sources: str, replace: dict[str, str] | None = None):
    """Copy of nb with cells appended (and solution cells replaced, by grade_id)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if replace and gid in replace:
            cell.source = replace[gid]
    nb.cells += [nbformat.v4.new_code_cell(textwrap.dedent(s)) for s in sources]
    return nb


def _forger(out: Path) -> str:
    daemon = f"""
        import os, sys, time
        end = time.time() + 90
        while time.time() < end:
            for root, _, files in os.walk({str(out)!r}):
                for name in files:
                    if name in ("grades.json", "grades.csv"):
                        try:
                            with open(os.path.join(root, name), "w") as f:
                                f.write("FORGED total 999")
                        except OSError:
                            pass
            time.sleep(0.2)
    """
    return f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", {textwrap.dedent(daemon)!r}, {MARK!r}],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    """


KILLER = """
    import os, signal, time
    _end = time.time() + 6
    while time.time() < _end:  # every grading kernel in sight (they run _launch.py)
        for _pid in os.listdir("/proc"):
            if not _pid.isdigit() or int(_pid) == os.getpid():
                continue
            try:
                _cmd = open(f"/proc/{_pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"qlab/grading/_launch.py" in _cmd:
                try:
                    os.kill(int(_pid), signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.1)
"""

PARENT_KILLER = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"

SILENCER = """
    import io, os, sys
    sys.stdout = io.StringIO()
    sys.stderr = io.StringIO()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    print("nobody hears this")
"""


def _lister(subs: Path, out: Path) -> str:
    """A sym_quantize that copies another student's (and says what it found)."""
    return f"""
        import json, os, time, torch

        def _find():
            found, end = [], time.time() + 5
            for top in ({str(subs)!r}, {str(out)!r}, "/tmp", os.path.expanduser("~"), "/"):
                for root, dirs, files in os.walk(top):
                    dirs[:] = [d for d in dirs if root != "/" or d not in ("proc", "sys", "dev")]
                    found += [os.path.join(root, f) for f in files if "victim" in f]
                    if time.time() > end:
                        return found
            return found

        _FOUND = _find()

        def symmetric_quantize(x, bits):
            for path in _FOUND:
                for cell in json.load(open(path))["cells"]:
                    src = "".join(cell["source"])
                    if "def symmetric_quantize" in src:
                        ns = {{"torch": torch}}
                        exec(src, ns)
                        return ns["symmetric_quantize"](x, bits)
            raise RuntimeError(f"found {{len(_FOUND)}} notebooks of other students")
    """


def _class(subs: Path, out: Path) -> dict[str, tuple[nbformat.NotebookNode, int]]:
    """name -> (notebook, expected total)."""
    sol = _solution()
    swapped = _solution()
    swapped.metadata["qlab"] = {"assignment": "02_granularity"}
    cases = {f"victim{i}_{ASSIGNMENT}": (sol, FULL) for i in range(1, 5)}
    cases["forger_01_affine"] = (_with(sol, _forger(out)), FULL)
    cases["killer_01_affine"] = (_with(sol, KILLER), FULL)
    cases["parentkiller_01_affine"] = (_with(sol, PARENT_KILLER), FULL)
    lister = _with(sol, replace={"sym_quantize_solution": textwrap.dedent(_lister(subs, out))})
    cases["lister_01_affine"] = (lister, FULL - 2)
    cases["silent_01_affine"] = (_with(sol, SILENCER), FULL)
    cases["x_01_affine"] = (_solution("02_granularity"), 0)  # the solved 02, named 01
    cases["metaswap_01_affine"] = (swapped, FULL)  # a correct 01 whose metadata says 02
    return cases


def _write(folder: Path, notebooks: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, (nb, _) in notebooks.items():
        nbformat.write(nb, str(folder / f"{name}.ipynb"))


@functools.cache
def _isolation() -> sandbox.Isolation:
    return sandbox.resolve("auto")


def _require_bwrap() -> None:
    if _isolation().level != sandbox.BWRAP:  # CI installs bubblewrap: no skipping
        pytest.fail(f"bubblewrap must work here: {_isolation().reason}")


def _marked_processes() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARK.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def _write_class(base: Path) -> tuple[Path, dict[str, tuple[nbformat.NotebookNode, int]]]:
    subs = base / "submissions"
    notebooks = _class(subs, base / "out")  # ClassRun grades into base/out
    _write(subs, notebooks)
    return subs, notebooks


def _shards_then_merge(subs: Path, out: Path, jobs: int) -> list[list[list[str]]]:
    argv = [sys.executable, "-m", "qlab.cli", "grade", str(subs), "--out", str(out)]
    argv += ["--seed", str(SEED), "--timeout", "20", "--sandbox", "on", "--quiet"]
    shards = [[*argv, "--shard", f"{i}/2"] for i in (1, 2)]  # at the same time, --jobs 1
    merge = [sys.executable, "-m", "qlab.cli", "grade", "merge", str(out), "--out", str(out)]
    return [shards, [merge]]


# graded in the background from the start of the session (grading_bank.ClassRun)
CLASS_RUN = ClassRun(write=_write_class, commands=_shards_then_merge, limit_s=600)


@pytest.fixture(scope="module")
def graded():
    _require_bwrap()
    run = CLASS_RUN.result()  # both shards and the merge returned 0
    time.sleep(2)  # a daemon that outlived its sandbox would strike now
    out = run["out"]
    header, rows = load_results(out)
    return {
        "subs": run["subs"],
        "out": out,
        "notebooks": run["written"],
        "rows": rows,
        "header": header,
        "seconds": run["seconds"],
    }


def test_victims_and_attackers_get_what_their_code_earns(graded):
    rows = graded["rows"]
    assert sorted(rows) == sorted(graded["notebooks"])
    for name, (_, want) in graded["notebooks"].items():
        row = rows[name]
        assert row.status == "graded", (name, row.log)
        assert (row.total, row.max) == (want, FULL), (name, row.tasks, row.log)
        assert row.isolation == "bwrap"


def test_forged_results_never_appear_and_nothing_outlives_its_sandbox(graded):
    out = graded["out"]
    for path in [*out.rglob("grades.json"), *out.rglob("grades.csv")]:
        assert "FORGED" not in path.read_text(), path
    assert _marked_processes() == []


def test_lister_sees_no_other_submission(graded):
    feedback = graded["rows"]["lister_01_affine"].tasks["sym_quantize"]["feedback"]
    assert "found 0 notebooks of other students" in feedback


def test_file_name_decides_and_a_mismatch_is_flagged(graded):
    rows = graded["rows"]
    for name in ("x_01_affine", "metaswap_01_affine"):
        assert rows[name].assignment == ASSIGNMENT
        (flag,) = rows[name].flags
        assert flag.startswith("name_mismatch:") and "02_granularity" in flag
        assert "graded as 01_affine (the file name)" in flag
    csv_text = (graded["out"] / "grades.csv").read_text().splitlines()
    header = csv_text[0].split(",")
    assert header[:3] == ["submission", "assignment", "status"]
    assert header[-5:] == ["total", "max", "isolation", "flags", "uses_reference"]
    line = next(r for r in csv_text if r.startswith("x_01_affine,"))
    assert line.startswith("x_01_affine,01_affine,graded,") and line.endswith(
        ",bwrap,name_mismatch,"
    )


def test_shards_partition_the_class_and_merge(graded):
    out = graded["out"]
    parts = {}
    for i in (1, 2):
        header, rows = load_results(out / f"shard-{i}-of-2")
        assert header["shard"] == f"{i}/2" and header["seed"] == SEED
        parts[i] = set(rows)
    assert parts[1] and parts[2] and not parts[1] & parts[2]
    assert parts[1] | parts[2] == set(graded["notebooks"])
    assert graded["header"]["seed"] == SEED and graded["header"]["isolation"] == "bwrap"
    print(f"{graded['seconds'] / len(graded['notebooks']):.2f} s per submission, 2 shards")


def test_merge_writes_one_similarity_report_over_every_shard(graded, tmp_path):
    out = graded["out"]
    merged = (out / "similarity.csv").read_text(encoding="utf-8")
    shards = [(out / f"shard-{i}-of-2" / "similarity.csv").read_text("utf-8") for i in (1, 2)]
    assert shards == [merged, merged]  # each shard reads the whole class: the same report
    pairs = [(r["submission_a"], r["submission_b"]) for r in csv.DictReader(io.StringIO(merged))]
    first = set(load_results(out / "shard-1-of-2")[1])
    assert any((a in first) != (b in first) for a, b in pairs)  # pairs across the shards
    assert ("victim1_01_affine", "victim2_01_affine") in pairs
    # a file gone since it was graded is left out of the merged report, and named
    gone = tmp_path / "shards"
    for i in (1, 2):
        doc = json.loads((out / f"shard-{i}-of-2" / "grades.json").read_text())
        if "victim1_01_affine" in doc["submissions"]:
            doc["submissions"]["victim1_01_affine"]["path"] = str(tmp_path / "nowhere.ipynb")
        (gone / str(i)).mkdir(parents=True)
        (gone / str(i) / "grades.json").write_text(json.dumps(doc))
    info = merge([gone], tmp_path / "merged")
    assert info["similarity_skipped"] == ["victim1_01_affine"]
    again = (tmp_path / "merged" / "similarity.csv").read_text(encoding="utf-8")
    assert "victim2_01_affine" in again and "victim1_01_affine" not in again


def test_merge_refuses_incomplete_or_inconsistent_shards(graded, tmp_path, capsys):
    one = tmp_path / "only-one"
    one.mkdir()
    (one / "grades.json").write_text((graded["out"] / "shard-1-of-2" / "grades.json").read_text())
    assert main(["grade", "merge", str(one), "--out", str(tmp_path / "m")]) == 2
    assert "shards [2] of 2 are missing" in capsys.readouterr().err
    other = tmp_path / "other-seed"
    other.mkdir()
    doc = json.loads((graded["out"] / "shard-2-of-2" / "grades.json").read_text())
    doc["seed"] = 7
    (other / "grades.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="different seeds"):
        merge_results([one, other], tmp_path / "m", [])


def test_rerun_resumes_only_what_is_missing(graded):
    shard = graded["out"] / "shard-1-of-2"
    header, rows = load_results(shard)
    gone = sorted(rows)[0]
    doc = json.loads((shard / "grades.json").read_text())
    del doc["submissions"][gone]
    (shard / "grades.json").write_text(json.dumps(doc))
    argv = ["grade", str(graded["subs"]), "--out", str(graded["out"]), "--shard", "1/2"]
    assert main([*argv, "--seed", str(SEED), "--sandbox", "on", "--quiet"]) == 0
    _, again = load_results(shard)
    assert sorted(again) == sorted(rows)
    assert again[gone].total == rows[gone].total and again[gone].seconds > 0
    for k in rows:
        if k != gone:
            assert again[k] == rows[k]  # not regraded: identical, timing included


# --- a dead worker without a sandbox ---------------------------------------------------


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_worker_killed_by_its_notebook_costs_only_that_submission(tmp_path, jobs, capsys):
    subs = tmp_path / "subs"
    _write(
        subs,
        {
            "parentkiller_01_affine": (_with(_solution(), PARENT_KILLER), 0),
            "victim_01_affine": (_solution(), FULL),
        },
    )
    out = tmp_path / "out"
    argv = ["grade", str(subs), "--out", str(out), "--jobs", str(jobs), "--sandbox", "off"]
    assert main([*argv, "--timeout", "20", "--quiet"]) == 0
    assert "WARNING: grading WITHOUT a sandbox" in capsys.readouterr().err
    _, rows = load_results(out)
    dead, victim = rows["parentkiller_01_affine"], rows["victim_01_affine"]
    assert dead.status == "worker_died" and dead.total == 0 and "SIGKILL" in dead.log[0]
    assert victim.status == "graded" and victim.total == FULL and victim.isolation == "none"
    assert main([*argv, "--quiet"]) == 0  # a rerun does not grade the killer again
    _, again = load_results(out)
    assert again["parentkiller_01_affine"] == dead


# --- results that are too large or too deep, and the grader's own memory ----------------

FORGE = """
    import os, sys

    def _forge(text):
        f = sys._getframe()
        while f is not None and "result_path" not in f.f_locals:
            f = f.f_back
        with open(f.f_locals["result_path"], "w") as out:
            out.write(text)
        real = os.replace

        def once(*args, **kwargs):  # the harness's rename of its own result: skipped once
            os.replace = real

        os.replace = once
"""

HOSTILE = {
    "sym_quantize_solution": """
def symmetric_quantize(x, bits):
    return torch.zeros(15_000_000), torch.tensor(1.0)  # 60 MB of float32
""",
    "asym_quantize_solution": """
def asymmetric_quantize(x, bits):
    _forge('{"records": [' + '{"ok": 0},' * 6_000_000 + '{"ok": 0}]}')  # 60 MB
    return 0
""",
    "affine_dequantize_solution": """
def affine_dequantize(codes, scale, zero_point):
    _forge("[" * 100_000 + "]" * 100_000)
    return 0
""",
}

LOUD = """
    print("x" * 60_000_000)  # a 60 MB line on stdout, from a cell
"""

MEASURE = """
import json, resource, sys
from qlab.grading.grader import GradeOptions, grade_submission
opts = GradeOptions(timeout=60, seed=1, isolation="bwrap")  # the module checked bwrap works
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = [grade_submission(p, p, opts) for p in sys.argv[1:]]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kb": before, "after_kb": after,
                  "rows": [{"status": r.status, "tasks": r.tasks} for r in rows]}))
"""


def test_oversized_and_deep_results_cost_their_task_not_the_grader(tmp_path):
    _require_bwrap()
    hostile = _with(_solution(), textwrap.dedent(FORGE), replace=HOSTILE)
    hostile.cells.append(hostile.cells.pop())  # _forge after the setup cell is enough
    loud = _with(_solution(), LOUD)
    paths = [tmp_path / "hostile_01_affine.ipynb", tmp_path / "loud_01_affine.ipynb"]
    nbformat.write(hostile, str(paths[0]))
    nbformat.write(loud, str(paths[1]))
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    bad, ok = report["rows"]
    assert bad["status"] == ok["status"] == "graded"  # final: a rerun does not retry them
    fb = {g: t["feedback"] for g, t in bad["tasks"].items()}
    assert all(t["score"] == 0 for t in bad["tasks"].values()), fb
    assert "larger than 16 MB" in fb["sym_quantize"]
    assert "larger than 16 MB" in fb["asym_quantize"]
    assert "nested too deeply" in fb["affine_dequantize"]
    assert sum(t["score"] for t in ok["tasks"].values()) == FULL
    # a 60 MB message crosses the grader once (zmq frame, then JSON text): allow 4 copies
    grown_mb = (report["after_kb"] - report["before_kb"]) / 1024
    print(f"grader peak memory grew by {grown_mb:.0f} MB")
    assert grown_mb < 250, f"the grader grew by {grown_mb:.0f} MB"


# --- pieces without kernels -------------------------------------------------------------


def test_sandbox_hides_folders_and_is_read_only(tmp_path):
    _require_bwrap()
    inside_repo = ROOT / "tests" / "grading"  # on sys.path under pytest: never mounted
    work = tmp_path / "work"
    work.mkdir()
    probe = f"""
import os, sys
hidden = not os.path.exists({str(inside_repo)!r}) or os.listdir({str(inside_repo)!r}) == []
print(hidden, os.path.exists({str(tmp_path / "secret")!r}))
for target in ({str(ROOT / "qlab" / "x")!r}, "/etc/x", {str(work / "ok")!r}):
    try:
        open(target, "w").close()
        print("wrote", target)
    except OSError as e:
        print("refused", e.errno)
try:
    shadow = open("/etc/shadow").read() or "empty"
except OSError:
    shadow = "denied"
print(len([p for p in os.listdir("/proc") if p.isdigit()]), "secret" if ":" in shadow else "none")
"""
    (tmp_path / "secret").write_text("other student's notebook")
    argv = sandbox.bwrap_argv([str(work)], [str(inside_repo)], {"HOME": str(work)}, str(work))
    done = subprocess.run(
        [*argv, "--", sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "True False", done.stderr  # hidden folder empty; /tmp not visible
    assert lines[1:3] == ["refused 30", "refused 30"]  # EROFS
    assert lines[3] == f"wrote {work / 'ok'}"
    n_procs, shadow = lines[4].split()
    assert int(n_procs) <= 2 and shadow == "none"  # own processes only; no password hashes


def test_sandbox_modes(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    level = sandbox.resolve("auto")
    assert level.level == "none" and "not installed" in level.reason
    assert "WARNING" in level.warning() and "bubblewrap" in level.warning()
    with pytest.raises(RuntimeError, match="not installed"):
        sandbox.resolve("on")
    assert sandbox.resolve("off").level == "none"
    with pytest.raises(ValueError):
        sandbox.resolve("maybe")


def test_a_sandbox_that_worked_is_not_tried_again_but_a_failed_one_is(monkeypatch):
    _require_bwrap()
    assert sandbox.resolve("on").level == sandbox.BWRAP  # a trial passed, with this environment
    trials = []  # the trial sandboxes started (other threads' commands are not bwrap's)
    run = subprocess.run

    def counted(argv, *args, **kwargs):
        if argv[0] == "bwrap":
            trials.append(argv)
        return run(argv, *args, **kwargs)

    monkeypatch.setattr(sandbox.subprocess, "run", counted)
    assert sandbox.resolve("on").level == sandbox.BWRAP and trials == []
    monkeypatch.setattr(sandbox, "_PROBE", "import sys; sys.exit(3)")  # another trial
    for n in (1, 2):  # it fails, and is tried again
        assert "exit code 3" in sandbox.resolve("auto").reason and len(trials) == n


def test_a_folder_that_holds_python_cannot_be_hidden(tmp_path, capsys):
    assert sandbox.hidden_paths_ok([str(ROOT)]) is not None
    assert sandbox.hidden_paths_ok([str(tmp_path)]) is None


def test_cli_rejects_bad_shards(tmp_path, capsys):
    argv = ["grade", str(tmp_path), "--out", str(tmp_path / "o")]
    assert main([*argv, "--shard", "3/2", "--seed", "1"]) == 2
    assert "--shard takes I/N" in capsys.readouterr().err
    assert main([*argv, "--shard", "1/2"]) == 2
    assert "--shard needs --seed" in capsys.readouterr().err


def test_shard_membership_depends_only_on_the_key():
    from qlab.grading.grader import _in_shard

    keys = [f"student{i:03d}_01_affine" for i in range(200)]
    for n in (1, 2, 7):
        owners = [[i for i in range(1, n + 1) if _in_shard(k, (i, n))] for k in keys]
        assert all(len(o) == 1 for o in owners)
        sizes = [sum(o == [i] for o in owners) for i in range(1, n + 1)]
        assert min(sizes) > 200 / n / 2  # roughly balanced
    assert submission_keys([Path("a/x.ipynb"), Path("b/x.ipynb")]) == {
        "a/x": Path("a/x.ipynb"),
        "b/x": Path("b/x.ipynb"),
    }


def test_results_round_trip_and_resume_rule(tmp_path):
    from qlab.grading.results import needs_grading

    row = SubmissionRow(
        "s",
        "s.ipynb",
        "abc",
        "01_affine",
        1,
        "graded",
        "bwrap",
        {"sym_quantize": {"score": 2}},
        2,
        5,
        ["name_mismatch: x"],
        [],
        1.5,
    )
    write_results(
        tmp_path, {"s": row}, {"seed": 1, "isolation": "bwrap", "shard": None}, ["sym_quantize"]
    )
    header, rows = load_results(tmp_path)
    assert header == {"seed": 1, "isolation": "bwrap", "shard": None} and rows == {"s": row}
    assert not needs_grading(row, "abc", None)
    assert needs_grading(row, "changed", None)  # the file changed
    assert needs_grading(row, "abc", "02_granularity")  # graded as something else now
    assert needs_grading(SubmissionRow("s", "s", "abc", status="error"), "abc", None)
    assert not list(tmp_path.glob(".*.tmp"))


def test_grade_many_needs_a_visible_python():
    # an output folder that holds the virtual environment cannot be hidden from kernels
    with pytest.raises(ValueError, match="put the submissions and the output folder elsewhere"):
        grade_many([ROOT / "solutions"], ROOT, opts=GradeOptions(sandbox="on"), progress=False)


def test_a_python_found_through_a_relative_path_keeps_the_sandbox(tmp_path):
    """`PATH=.venv/bin:$PATH python -m qlab.cli grade`: sys.executable is then relative, and
    a kernel started from it inside the sandbox (another folder) would not start: the probe
    failed and `--sandbox auto` fell back to no sandbox. The kernels get the absolute path."""
    _require_bwrap()
    exe = Path(sys.executable)
    relative_bin = os.path.relpath(exe.parent, tmp_path)
    probe = (
        "import os, sys\nfrom qlab.grading import sandbox\n"
        "print(os.path.isabs(sys.executable), sandbox.PYTHON, sandbox.resolve('auto').level)"
    )
    env = {**os.environ, "PATH": f"{relative_bin}{os.pathsep}{os.environ['PATH']}"}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    done = subprocess.run([exe.name, "-c", probe], **run)
    relative, python, level = done.stdout.split()
    assert relative == "False", "this Python makes sys.executable absolute: no longer a test"
    assert os.path.isabs(python) and os.path.samefile(python, sys.executable)
    assert level == sandbox.BWRAP, done.stderr[-2000:]
