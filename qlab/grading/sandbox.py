"""Isolation of the kernels that ``qlab grade`` starts: bubblewrap (``bwrap``) when it works.

Two levels, recorded in every row of grades.json and grades.csv (``isolation``):

- ``"bwrap"``: each kernel runs in its own bubblewrap sandbox (Debian/Ubuntu package
  ``bubblewrap``): its own PID namespace (it sees and can signal only its own
  processes; the grader, the other kernels and the notebook's parent are out of reach),
  no network (the kernel talks to the grader over Unix sockets in a folder the sandbox
  shares: jupyter_client's ``ipc`` transport), no capabilities, a clean environment,
  and a file system that holds only the operating system (/usr, /etc without its
  secrets), the Python installation, its site-packages and the installed qlab package
  (never the working directory or another ``sys.path`` entry), all read-only,
  plus two private writable folders (its working directory, a tmpfs of the submission's
  disk quota, and its socket folder).
  The submissions and output folders, /tmp, /run and the home directories are not
  visible. When the submission is done the sandbox's init process is killed, and with
  it every process the notebook started (``--die-with-parent``, ``--unshare-pid``).
- ``"none"``: the kernel runs as a plain child process of the grader, with the same
  limits (memory, CPU time, file size, wall clock) but the grading user's view of the
  machine: it can read other submissions, signal other processes, and leave processes
  behind. Used where bwrap is missing or cannot create namespaces (macOS, containers
  without user namespaces), with a loud warning, or when asked (``--sandbox off``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BWRAP", "NONE", "PYTHON", "Isolation", "resolve", "bwrap_argv", "hidden_paths_ok"]

BWRAP = "bwrap"
NONE = "none"
MODES = ("auto", "on", "off")
# the interpreter of the kernels, as an absolute path taken when qlab.grading loads:
# sys.executable is relative when Python was found through a relative PATH entry
# (PATH=.venv/bin:$PATH), and a kernel starts in another folder (inside the sandbox, or
# its work folder). Not resolved: a venv's python is a link that must stay a link.
PYTHON = os.path.abspath(sys.executable)

# read-only system folders every Python needs; symlinks (merged /usr) stay symlinks
_SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# readable only by root, but the grader may run as root (CI, containers): masked
_SECRET_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-")
_SECRET_DIRS = ("/etc/ssl/private", "/etc/ssh")
# environment variables that pass into the sandbox (everything else is cleared)
_PASS_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "LD_LIBRARY_PATH")
# run inside a trial sandbox: /proc shows only its own processes (bwrap's init and this
# Python), and what every grading kernel imports loads from the read-only mounts
_PROBE = """
import os, sys
own = sum(p.isdigit() for p in os.listdir("/proc"))
import ipykernel.kernelapp, torch
sys.exit(3 if own > 3 else 0)
"""


@dataclass(frozen=True)
class Isolation:
    """The isolation level of a grading run, and why it is not bwrap when it is not."""

    level: str  # BWRAP or NONE
    reason: str = ""

    def warning(self) -> str | None:
        if self.level == BWRAP:
            return None
        text = (
            f"WARNING: grading WITHOUT a sandbox ({self.reason}). Student code runs as you: "
            "it can read the other submissions, signal other kernels and the grader, and "
            "leave processes behind."
        )
        if self.reason != "--sandbox off":
            text += " Install bubblewrap (apt-get install bubblewrap) or grade untrusted work"
            text += " inside a throwaway VM."
        return text


def python_roots() -> list[str]:
    """Folders the kernel's Python needs: its installation, its site-packages and the
    installed qlab (an editable install maps it into a checkout: only its package folders).
    Never ``sys.path`` as such: started from a checkout, or with PYTHONPATH pointing at
    one, that would hold the working directory (solutions/, .git)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.add(str(Path(PYTHON).resolve().parent.parent))
    roots.update(p for p in site.getsitepackages() if os.path.isdir(p))
    user_site = site.getusersitepackages()
    if site.ENABLE_USER_SITE and os.path.isdir(user_site):
        roots.add(user_site)
    libs = os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    roots.update(p for p in libs if os.path.isabs(p) and os.path.isdir(p))
    for name in ("qlab", "qlab.kernels"):  # editable installs map packages anywhere
        spec = importlib.util.find_spec(name)
        if spec is not None:
            roots.update(spec.submodule_search_locations or [])
    real = {os.path.realpath(p) for p in roots}
    # drop folders inside other folders of the set (one bind mount each is enough)
    return sorted(p for p in real if not any(p != q and _inside(p, q) for q in real))


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _visible(path: str, roots: list[str]) -> bool:
    return any(_inside(path, r) for r in roots)


def _system_binds() -> list[str]:
    args: list[str] = []
    for p in _SYSTEM:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    for f in _SECRET_FILES:
        if os.path.exists(f):
            args += ["--ro-bind", "/dev/null", f]
    for d in _SECRET_DIRS:
        if os.path.isdir(d):
            args += ["--tmpfs", d, "--remount-ro", d]
    return args


def hidden_paths_ok(hide: list[str]) -> str | None:
    """None, or why a folder that must stay hidden cannot be (it holds Python or qlab)."""
    for h in map(os.path.realpath, hide):
        for r in python_roots():
            if os.path.isdir(h) and _inside(r, h):
                return (
                    f"{h} contains {r}, which the grading kernels need to import Python "
                    "and qlab; put the submissions and the output folder elsewhere"
                )
    return None


def bwrap_argv(
    rw: list[str],
    hide: list[str],
    env: dict[str, str],
    chdir: str,
    scratch: dict[str, int] | None = None,
) -> list[str]:
    """The bwrap command line (up to ``--``) for one kernel.

    rw:   host folders the kernel may write (mounted at the same path);
    scratch: folder -> bytes: a private tmpfs of that size at that path (the kernel's
          working folder: its disk quota; nothing of it reaches the host's disk), with
          an empty ``tmp`` folder in it;
    hide: files and folders it must not see (submissions, output), even where they lie
          inside a folder it needs (e.g. a submissions folder inside the course repo);
    env:  the kernel's whole environment (plus PATH, LANG, ... from this process).
    """
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    args += ["--cap-drop", "ALL", "--clearenv"]
    base = {k: os.environ[k] for k in _PASS_ENV if k in os.environ}
    for k, v in {**base, **env}.items():
        args += ["--setenv", k, v]
    args += ["--proc", "/proc", "--dev", "/dev", *_system_binds()]
    tmps = sorted({"/tmp", os.path.realpath(tempfile.gettempdir())})
    for t in tmps:  # other kernels' folders live here: an empty, read-only /tmp instead
        args += ["--tmpfs", t]
    roots = python_roots()
    for r in roots:  # after the tmpfs: a venv or a checkout under /tmp stays importable
        args += ["--ro-bind", r, r]
    ro_again = [*tmps]
    for h in map(os.path.realpath, hide):  # only what a root brings back needs hiding
        if not os.path.exists(h) or not _visible(h, roots):
            continue
        if os.path.isdir(h):
            args += ["--tmpfs", h]
            ro_again.append(h)
        else:
            args += ["--ro-bind", "/dev/null", h]
    for p in map(os.path.realpath, rw):
        args += ["--bind", p, p]
    for p, size in (scratch or {}).items():
        p = os.path.realpath(p)
        args += ["--size", str(int(size)), "--tmpfs", p, "--dir", os.path.join(p, "tmp")]
    for p in [*ro_again, "/dev", "/"]:  # tmpfs mounts would let a kernel fill the RAM
        args += ["--remount-ro", p]
    return [*args, "--chdir", os.path.realpath(chdir)]


# the trials that passed in this process, by the bwrap found on PATH, the Python, the code
# and the sandbox's command line (the work folder left out). A trial starts a Python that
# imports PyTorch (1.7 s of CPU), and a process that grades several times (a notebook, a
# test session) need not repeat one that worked; one that failed is tried again next time.
_WORKED: set[tuple] = set()


def _probe() -> str | None:
    """None when a bwrap sandbox with this Python works here (or worked earlier in this
    process, with the same command line), else what went wrong."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bwrap is not installed"
    same = "/qlab-probe-work"  # in the key, for the work folder each trial makes
    key = (exe, PYTHON, _PROBE, *bwrap_argv([same], [], {"HOME": same}, same))
    if key in _WORKED:
        return None
    work = tempfile.mkdtemp(prefix="qlab-probe-")
    try:
        argv = bwrap_argv([work], [], {"HOME": work}, work)
        argv += ["--", PYTHON, "-c", _PROBE]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap failed to run: {e}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if done.returncode != 0:
        err = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return f"bwrap cannot create a sandbox here: {err[:200]}"
    _WORKED.add(key)
    return None


def resolve(mode: str) -> Isolation:
    """The isolation to use for ``--sandbox MODE``: auto (bwrap if it works), on, off.

    Raises RuntimeError for ``on`` when bwrap does not work here.
    """
    if mode not in MODES:
        raise ValueError(f"--sandbox takes one of {MODES}, got {mode!r}")
    if mode == "off":
        return Isolation(NONE, "--sandbox off")
    if sys.platform != "linux":
        problem = f"bwrap needs Linux; this is {sys.platform}"
    else:
        problem = _probe()
    if problem is None:
        return Isolation(BWRAP)
    if mode == "on":
        raise RuntimeError(f"--sandbox on: {problem}")
    return Isolation(NONE, problem)
