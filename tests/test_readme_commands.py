"""Every command in README.md and docs/*.md runs, from a clean clone, as a learner runs it.

What counts as a command: each line (backslash continuations joined) of a fenced code
block labelled bash, sh, shell or console, or with no label, in README.md and
docs/*.md. A block that starts with a shebang (#!) is a script file and runs as one (with
SCRIPT_ENV, e.g. a Slurm array's task id). Label anything else (```text, ```python).

Each file's commands run in order in one bash session at the root of a clean clone (git
clone of HEAD, plus the working tree's uncommitted changes to tracked files and its
untracked files that git does not ignore: no .venv, no site/, no my_work/). README.md
runs first and gets nothing it does not say: a command that needs the course's
environment before the README activates it fails, as it would for a learner. Each docs/
page starts by activating the environment the README's way. The python blocks of the
pages in RUN_PYTHON_BLOCKS run too (they must not raise).

Commands that take long, keep running, need a GPU or need a tool CI may lack are marked
in their comment (a word of MARKS: "long", "keeps running", "GPU", "needs ...") and run
here in a cheap mode from CHEAP: a dry run (make -n), --help, a syntax check, or "serve"
(start it, wait until JupyterLab answers on its URL, stop it). A marked command without
a cheap mode, a cheap mode whose command is in no doc, and an unmarked command that runs
past COMMAND_TIMEOUT_S all fail the test. Inline commands in prose (`make ...`,
`qlab ...`) must start like a tested command, so none escapes.

The clone's .venv is made fast rather than installed: a venv from .venv's base Python
that sees .venv's packages through a .pth line (not .venv's editable qlab, whose .pth is
not processed), with the clone's own qlab installed editable and .venv's console scripts
(jupyter, pytest, ...) copied with the clone's Python in their shebang; its set-up stamp
is touched, so `make setup` finds it done. Installing from nothing is what CI's .ci/run
does every run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv"
SHELL_LABELS = {"", "bash", "sh", "shell", "console"}
RUN_PYTHON_BLOCKS = ("README.md", "docs/LEARNERS.md")  # pages whose python blocks run
COMMAND_TIMEOUT_S = 300  # one unmarked command; longer ones must be marked and get a cheap mode
SERVE_TIMEOUT_S = 120  # JupyterLab's start on a busy 2-core machine
MARKS = re.compile(r"\b(long|keeps running|GPU|needs [\w-]+)\b")
SERVE = "serve"  # cheap mode: start it, see JupyterLab answer, stop it
# command as written (comment stripped) -> its cheap mode
CHEAP: dict[str, str] = {
    "make lab": SERVE,
    "make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu": (
        "make -n lab TORCH_INDEX=https://download.pytorch.org/whl/cpu"
    ),
    "jupyter lab": SERVE,
    "make test": "make -n test",  # CI runs it for real: .ci/run
    "make test-fast": "make -n test-fast",  # a subset of what `make test` runs
    "make site": "make -n site",  # tests/site/test_site_browser.py builds the site for real
    'make site SITE_ARGS="--only 00 02"': "make -n site SITE_ARGS='--only 00 02'",
    "make system-deps": "make -n system-deps",  # apt-get: root or sudo
    "make llamacpp": "make -n llamacpp",  # compiles llama.cpp: minutes (docs/LEARNERS.md)
    "make test-llamacpp": "make -n test-llamacpp",  # the same build, then its tests
    "conda env create -f environment.yml": (
        "python -c \"import yaml; assert yaml.safe_load(open('environment.yml'))['name']\""
    ),
    "bash benchmarks/gpu_session.sh": "bash -n benchmarks/gpu_session.sh",
    # on a CPU both bench lines check the same candidates on the same small shape (only the
    # roofline model's shape list differs), and the --quick line runs for real
    "python -m qlab.kernels.bench": "python -m qlab.kernels.bench --help",
    "python benchmarks/bench_contention.py 00": "python benchmarks/bench_contention.py --help",
}
SCRIPT_ENV = {"SLURM_ARRAY_TASK_ID": "1"}  # what a batch system sets for a script block
INLINE = re.compile(r"`((?:make|qlab|python3?|pip|jupyter|pytest|conda|bash) [^`]*)`")


# ---------------------------------------------------------------- reading the docs


def doc_files(root: Path) -> list[str]:
    """README.md first, then docs/*.md (repo-relative)."""
    return ["README.md"] + sorted(f"docs/{p.name}" for p in (root / "docs").glob("*.md"))


def blocks(text: str) -> list[tuple[str, int, str]]:
    """Fenced code blocks as (label, line number of the first body line, body)."""
    found, label, start, body = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```+\s*([\w+-]*)", line)
        if fence and label is None:
            label, start, body = fence.group(1).lower(), i + 1, []
        elif fence and not fence.group(1):
            found.append((label, start, "\n".join(body)))
            label = None
        elif label is not None:
            body.append(line)
    return found


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment) of one shell line: a # after a blank, outside quotes, starts it."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].strip(), line[i + 1 :].strip()
    return line.strip(), ""


def commands(root: Path, rel: str) -> list[dict]:
    """The shell commands and scripts of one page, in order, with where they are."""
    out = []
    for label, start, body in blocks((root / rel).read_text()):
        if label not in SHELL_LABELS:
            continue
        if body.lstrip().startswith("#!"):
            out.append({"where": f"{rel}:{start}", "script": body, "cmd": None})
            continue
        joined, first = "", start
        for n, line in enumerate(body.splitlines(), start):
            if not joined:
                first = n
            joined += line.rstrip()
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            cmd, comment = split_comment(joined)
            if cmd:
                out.append({"where": f"{rel}:{first}", "cmd": cmd, "comment": comment})
            joined = ""
    return out


def python_blocks(root: Path, rel: str) -> list[tuple[str, str]]:
    return [
        (f"{rel}:{s}", b) for label, s, b in blocks((root / rel).read_text()) if label == "python"
    ]


# ---------------------------------------------------------------- the clean clone


def clean_clone(dest: Path) -> Path:
    """git clone of HEAD plus the working tree's changes (tracked and untracked, not ignored)."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--modified", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for rel in filter(None, listed):
        src, dst = REPO / rel, dest / rel
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        elif dst.exists():  # deleted in the working tree
            dst.unlink()
    return dest


def fast_venv(clone: Path) -> None:
    """clone/.venv: .venv's packages through a .pth line, the clone's qlab editable, scripts."""
    base = Path(sys._base_executable)
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(clone / ".venv")], check=True)
    py = clone / ".venv" / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # a plain path line: .venv's own .pth files (its editable qlab) are not processed
    Path(purelib, "_qlab_course_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."],
        cwd=clone,
        check=True,
        capture_output=True,
    )
    main_bin, bin_ = VENV / "bin", clone / ".venv" / "bin"
    for script in main_bin.iterdir():
        if (bin_ / script.name).exists() or not script.is_file():
            continue
        head = script.read_bytes()[:200].split(b"\n")[0]
        if head.startswith(b"#!") and str(main_bin / "python").encode() in head:
            rest = script.read_text().split("\n", 1)[1]  # a console script: the clone's Python
            (bin_ / script.name).write_text(f"#!{py}\n{rest}")
            (bin_ / script.name).chmod(0o755)
        elif not head.startswith(b"#!") and os.access(script, os.X_OK):
            (bin_ / script.name).symlink_to(script)  # a binary such as ruff
    (clone / ".venv" / ".qlab-installed").touch()  # the Makefile's set-up stamp


# ---------------------------------------------------------------- running them

PRELUDE = r"""
set -uo pipefail
fail() { echo "FAILED at $1: $2"; exit 1; }
run() {  # where, command: one command in a child shell, with a time limit
  echo "+ [$1] $2"
  timeout --kill-after=10 %(timeout)d bash -c "$2" || fail "$1" "$2 (exit $?)"
}
answers() {  # url: it answers HTTP 200
  python3 -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)" \
    "$1" 2>/dev/null
}
serve() {  # where, command: it keeps running; JupyterLab must answer on the URL it prints
  echo "+ [$1] $2   (started, then stopped once it serves)"
  local log; log=$(mktemp)
  setsid bash -c "$2" >"$log" 2>&1 & local pid=$!
  for _ in $(seq %(polls)d); do
    local url; url=$(grep -oE 'http://127\.0\.0\.1:[0-9]+/lab\?token=[0-9a-f]+' "$log" | head -1)
    if [ -n "$url" ] && answers "${url/\/lab\?token=//api/status?token=}"; then
      kill -- -"$pid"; wait "$pid" 2>/dev/null; return 0
    fi
    kill -0 "$pid" 2>/dev/null || { cat "$log"; fail "$1" "$2 exited instead of serving"; }
    sleep 0.5
  done
  cat "$log"; kill -- -"$pid"; fail "$1" "$2 did not serve in %(serve)d s"
}
"""


def script_for(rel: str, cmds: list[dict], tmp: Path) -> str:
    """The bash session of one page: its commands, in order, each checked."""
    lines = [
        PRELUDE
        % {"timeout": COMMAND_TIMEOUT_S, "polls": SERVE_TIMEOUT_S * 2, "serve": SERVE_TIMEOUT_S}
    ]
    if rel != "README.md":
        lines.append(". .venv/bin/activate || fail setup 'activate the venv'")
    for i, c in enumerate(cmds):
        where = shlex.quote(c["where"])
        if c.get("script") is not None:
            path = tmp / f"script_{rel.replace('/', '_')}_{i}.sh"
            path.write_text(c["script"])
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in SCRIPT_ENV.items())
            lines.append(f"run {where} {shlex.quote(f'{env} bash {path}')}")
            continue
        cmd = c["cmd"]
        cheap = CHEAP.get(cmd)
        if cheap == SERVE:
            lines.append(f"serve {where} {shlex.quote(cmd)}")
        elif cheap:
            lines.append(f"run {where} {shlex.quote(cheap)}")
        elif re.match(r"^(\.|source|cd|export)\s", cmd):  # changes this shell: run it here
            lines.append(f"echo {shlex.quote('+ [' + c['where'] + '] ' + cmd)}")
            lines.append(f"{cmd} || fail {where} {shlex.quote(cmd)}")
        else:
            lines.append(f"run {where} {shlex.quote(cmd)}")
    lines.append("echo ALL-COMMANDS-RAN")
    return "\n".join(lines) + "\n"


def learner_env(tmp: Path) -> dict:
    """The environment of a fresh terminal: no venv active, JupyterLab's state kept in tmp."""
    # nor the variables of the `make test` that runs these tests (make -n would then print
    # "Entering directory ...")
    inherited = ("VIRTUAL_ENV", "PYTHONPATH", "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    parts = [
        p for p in env.get("PATH", "").split(os.pathsep) if not (Path(p) / "activate").exists()
    ]
    env["PATH"] = os.pathsep.join(parts)
    config = tmp / "jupyter-config"  # CI runs as root, which JupyterLab refuses by default
    config.mkdir(exist_ok=True)
    (config / "jupyter_server_config.json").write_text('{"ServerApp": {"allow_root": true}}')
    env.update(
        JUPYTER_CONFIG_DIR=str(config),
        BROWSER="true",  # `jupyter lab` opens no browser
        JUPYTER_RUNTIME_DIR=str(tmp / "jupyter-runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp / "jupyter-workspaces"),
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "jupyter-settings"),
        MPLBACKEND="Agg",
    )
    return env


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if not (VENV / "bin" / "python").exists():
        pytest.fail("no .venv: run `make setup` first (the clone borrows its packages)")
    root = clean_clone(tmp_path_factory.mktemp("clone") / "qlab")
    fast_venv(root)
    return root


def test_marked_commands_have_a_cheap_mode_and_the_rest_are_not_marked():
    every = {c["cmd"]: c for rel in doc_files(REPO) for c in commands(REPO, rel) if c["cmd"]}
    assert "make lab" in every and "make test" in every, "the README's two headline commands"
    for cmd, c in every.items():
        marked = bool(MARKS.search(c["comment"]))
        assert marked == (cmd in CHEAP), f"{c['where']}: `{cmd}` " + (
            "is marked but has no cheap mode in CHEAP"
            if marked
            else "has a cheap mode in CHEAP but its comment does not say why (long, keeps "
            "running, GPU, needs ...)"
        )
    stale = set(CHEAP) - set(every)
    assert not stale, f"CHEAP lists commands that no doc has any more: {sorted(stale)}"


def test_inline_commands_are_tested_commands():
    starts = set()
    for rel in doc_files(REPO):
        for c in commands(REPO, rel):
            words = (c["cmd"] or c["script"]).split()
            starts |= {" ".join(words[:n]) for n in (1, 2)}
    for rel in doc_files(REPO):
        for m in INLINE.finditer((REPO / rel).read_text()):
            words = m.group(1).split()
            head = (
                " ".join(words[:2]) if len(words) > 1 and not words[1].startswith("-") else words[0]
            )
            assert head in starts, (
                f"{rel}: the inline command `{m.group(1)}` is in no command block, so no test "
                "runs it: put it in a ```bash block (or start it like one)"
            )


@pytest.mark.parametrize("rel", doc_files(REPO))
def test_doc_commands_run_in_a_clean_clone(clone, rel, tmp_path):
    cmds = commands(clone, rel)
    if rel in RUN_PYTHON_BLOCKS:
        for where, code in python_blocks(clone, rel):
            path = tmp_path / f"block_{len(cmds)}.py"
            path.write_text(code)
            cmds.append({"where": where, "cmd": f"python {path}", "comment": ""})
    if not cmds:
        return  # a page without commands (the glossary): nothing to run
    script = tmp_path / "session.sh"
    script.write_text(script_for(rel, cmds, tmp_path))
    out = subprocess.run(
        ["bash", str(script)],
        cwd=clone,
        env=learner_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S * 4,
    )
    log = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0 and "ALL-COMMANDS-RAN" in out.stdout, log


def test_readme_is_a_page_for_people():
    readme = (REPO / "README.md").read_text()
    assert "section:" not in readme and "owner:" not in readme, "internal owner markers"
    assert "No GPU results are recorded yet" not in readme
    quick = readme.index("## Quick start")
    assert quick < readme.index("## The course"), "the learner's quick start comes first"
    # the quick start says how to set up, activate, open, where to work, check, solutions
    start = readme[quick : readme.index("## The course")]
    for needed in (
        "make lab",
        ". .venv/bin/activate",
        "make exercises",
        "my_work/",
        "check(",
        "solutions/",
    ):
        assert needed in start, f"the quick start does not mention {needed}"
    # every chapter notebook is in the course map, and every link there resolves
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert f"(notebooks/{nb.name})" in readme, f"README's course map lacks {nb.name}"
    for target in re.findall(r"\]\(([^)#\s]+)", readme):
        if not re.match(r"^[a-z]+:", target):
            assert (REPO / target).exists(), f"README links to a missing file: {target}"


def test_the_runner_fails_on_a_wrong_command(tmp_path):
    """A wrong command, a command the README needs activation for, a failing script: all fail."""
    env = learner_env(tmp_path)
    for cmd in ("qlab-does-not-exist --help", "make no-such-target", "false"):
        script = tmp_path / "s.sh"
        script.write_text(script_for("README.md", [{"where": "X:1", "cmd": cmd}], tmp_path))
        out = subprocess.run(
            ["bash", str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode != 0 and "FAILED at X:1" in out.stdout, (cmd, out.stdout)
    # before activation, the environment's commands are not on PATH (the bug)
    probe = subprocess.run(
        ["bash", "-c", "command -v jupyter || echo none"], env=env, capture_output=True, text=True
    )
    assert str(VENV) not in probe.stdout


def test_block_parser():
    text = (
        "x\n```bash\nmake lab   # keeps running: opens it\nqlab grade a \\\n  --out b\n```\n"
        "```python\nprint(1)\n```\n```text\nnot a command\n```\n"
    )
    cmds = commands_from_text(text)
    assert [c["cmd"].split() for c in cmds] == [["make", "lab"], "qlab grade a --out b".split()]
    assert cmds[0]["comment"] == "keeps running: opens it" and MARKS.search(cmds[0]["comment"])
    assert split_comment("echo 'a # b'  # c") == ("echo 'a # b'", "c")


def commands_from_text(text: str) -> list[dict]:
    """commands() for a string (the parser's own test)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "X.md").write_text(text)
        return commands(Path(d), "X.md")


def test_my_work_is_a_safe_workspace(clone, tmp_path):
    """`make exercises` copies, never overwrites; git, make test, ruff and assign ignore it."""
    env = dict(
        learner_env(tmp_path),
        PATH=f"{clone / '.venv' / 'bin'}{os.pathsep}" + learner_env(tmp_path)["PATH"],
    )

    def sh(cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", cmd],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )

    shutil.rmtree(clone / "my_work", ignore_errors=True)
    first = sh("make exercises")
    names = sorted(p.name for p in (clone / "exercises").glob("[0-9][0-9]_*.ipynb"))
    assert first.returncode == 0 and sorted(p.name for p in (clone / "my_work").iterdir()) == names
    # the learner's work: a solved cell with outputs and a line ruff would reject
    mine = clone / "my_work" / names[0]
    nb = nbformat.read(mine, as_version=4)
    cell = nbformat.v4.new_code_cell("answer = " + "1 + " * 40 + "1")
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "41"})]
    nb.cells.append(cell)
    nbformat.write(nb, mine)
    saved = mine.read_bytes()
    (clone / "my_work" / names[1]).unlink()  # starting one exercise over
    again = sh("make exercises")
    assert again.returncode == 0 and mine.read_bytes() == saved  # never overwritten
    assert f"kept   my_work/{names[0]}" in again.stdout
    assert f"copied my_work/{names[1]}" in again.stdout
    # git does not see it, ruff does not lint it, qlab assign --check does not mind it
    assert sh("git status --porcelain --untracked-files=all my_work").stdout == ""
    lint = sh(f"ruff check --force-exclude my_work/{names[0]}")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "E501" in sh(f"ruff check --isolated --select E501 my_work/{names[0]}").stdout
    check = sh("qlab assign --check")
    assert check.returncode == 0, check.stdout + check.stderr
    # and the test command names its folders: my_work is never collected
    dry = sh("make -n test").stdout
    pytest_line = next(line for line in dry.splitlines() if " -m pytest " in line)
    assert "my_work" not in pytest_line and " tests " in pytest_line + " "
