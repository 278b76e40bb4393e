"""How much slower a chapter runs when other work competes for the cores (issue 26).

    python benchmarks/bench_contention.py 00 07 [--load 2] [--env GOMP_SPINCOUNT=300000]

Each chapter is executed as the site build and the tests execute it (docs/site/build.py
``execute``: a fresh kernel with qlab's thread policy, see qlab/_tensor.py) twice:

- idle: nothing started by this script runs beside it;
- loaded: beside ``--load`` busy processes (default 2, one per core of the course's
  2-core machine), each a Python loop that never sleeps (``while True: pass``): the
  synthetic stand-in for a classmate's kernel or a compiler on a shared machine. They
  run at normal priority and may run on any CPU.

It prints, per chapter, the wall time idle and loaded, their ratio (issue 26 asks for at
most 3x), the kernel's CPU time (user + sys) and the load average before each run: a
machine that other people's work already loads makes the idle time longer and the ratio
smaller, so read the ratio with the load beside it. ``--env KEY=VALUE`` (repeatable)
sets a variable for the kernels, e.g. ``GOMP_SPINCOUNT=300000`` to measure libgomp's
default busy-waiting instead of the policy's passive waiting. A benchmark, not a test:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUSY = "while True: pass"  # one process that keeps one CPU busy and never sleeps


def _site_build():
    """docs/site/build.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("qlab_site_build", REPO / "docs/site/build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("qlab_site_build", module)
    spec.loader.exec_module(module)
    return module


def _children_cpu_s() -> float:
    """User + sys seconds of every child process that has ended (the kernels)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(build, path: Path) -> tuple[float, float, float]:
    """(wall s, kernel CPU s, 1-minute load average before) of one execution of ``path``."""
    load = os.getloadavg()[0]
    cpu, start = _children_cpu_s(), time.monotonic()
    build.execute(path)
    return time.monotonic() - start, _children_cpu_s() - cpu, load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("chapters", nargs="+", help="chapter numbers, e.g. 00 07")
    p.add_argument("--load", type=int, default=2, help="busy processes beside the loaded run")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the kernels")
    args = p.parse_args(argv)
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value  # execute() starts each kernel with os.environ
    build = _site_build()
    paths = build.numbered(REPO / "notebooks", args.chapters)
    if not paths:
        p.error(f"no chapter notebooks/NN_*.ipynb for {args.chapters}")

    from qlab._tensor import thread_env, usable_cpus

    print(f"usable CPUs {usable_cpus()}, kernels get {thread_env()}, extra {args.env or 'none'}")
    print(f"load: {args.load} x python -c {BUSY!r}")
    print("chapter                     idle s  (cpu s, load)   loaded s  (cpu s, load)   ratio")
    for path in paths:
        idle = timed(build, path)
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
        try:
            time.sleep(1.0)  # the busy processes are running before the kernel starts
            loaded = timed(build, path)
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
        print(
            f"{path.stem[:26]:26} {idle[0]:8.1f}  ({idle[1]:5.1f}, {idle[2]:4.1f}) "
            f"{loaded[0]:9.1f}  ({loaded[1]:5.1f}, {loaded[2]:4.1f}) "
            f"{loaded[0] / idle[0]:6.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
