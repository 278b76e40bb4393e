"""Benchmark `qlab grade` with and without the bubblewrap sandbox, in the same run.

N submissions (the solution notebooks, round robin, each a fresh file) are graded once
with ``--sandbox off`` and once with ``--sandbox on``, alternating ``--rounds`` times
so that a busy machine slows both alike. Prints, per mode, the median seconds one
worker spends per notebook (the rows' ``seconds``) and the wall seconds per submission,
and the sandbox's ratio against no sandbox (goal: within 1.5x).

    python benchmarks/bench_grading.py [--n 12] [--jobs 2] [--rounds 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from qlab.grading.grader import GradeOptions, grade_many

ROOT = Path(__file__).resolve().parents[1]
GOAL_RATIO = 1.5


def _submissions(folder: Path, n: int) -> None:
    sources = sorted((ROOT / "solutions").glob("*.ipynb"))
    folder.mkdir(parents=True)
    for i in range(n):
        src = sources[i % len(sources)]
        nb = nbformat.read(str(src), as_version=4)
        nbformat.write(nb, str(folder / f"student{i:03d}_{src.stem}.ipynb"))


def _grade(subs: Path, out: Path, mode: str, jobs: int, timeout: float) -> dict:
    opts = GradeOptions(timeout=timeout, seed=1, sandbox=mode)
    start = time.perf_counter()
    rows = grade_many([subs], out, jobs=jobs, opts=opts, progress=False)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "per_notebook_s": [r.seconds for r in rows.values()],
        "full_marks": sum(r.total == r.max > 0 for r in rows.values()),
        "isolation": sorted({r.isolation for r in rows.values()}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=12, help="submissions per mode and round")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs to run")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--keep", default=None, help="keep submissions and grades in this folder")
    args = p.parse_args(argv)

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="qlab-bench-"))
    shutil.rmtree(work / "submissions", ignore_errors=True)
    _submissions(work / "submissions", args.n)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on"):
            out = work / f"out-{mode}-{r}"
            shutil.rmtree(out, ignore_errors=True)
            runs[mode].append(_grade(work / "submissions", out, mode, args.jobs, args.timeout))
    summary = {}
    for mode, results in runs.items():
        per = [s for res in results for s in res["per_notebook_s"]]
        summary[mode] = {
            "isolation": results[0]["isolation"],
            "median_s_per_notebook_per_worker": round(statistics.median(per), 2),
            "wall_s_per_submission": round(
                sum(res["wall_s"] for res in results) / (args.n * len(results)), 2
            ),
            "full_marks": sum(res["full_marks"] for res in results),
        }
    ratio = (
        summary["on"]["median_s_per_notebook_per_worker"]
        / summary["off"]["median_s_per_notebook_per_worker"]
    )
    summary["sandbox_ratio"] = round(ratio, 2)
    summary.update(n=args.n, jobs=args.jobs, rounds=args.rounds)
    print(json.dumps(summary, indent=1))
    print(
        f"sandbox on: {ratio:.2f}x the time per notebook without it "
        f"({'within' if ratio <= GOAL_RATIO else 'OVER'} the {GOAL_RATIO:g}x goal)"
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    expected = args.n * args.rounds
    ok = all(summary[m]["full_marks"] == expected for m in ("off", "on"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
