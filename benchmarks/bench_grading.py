"""Benchmark `qlab grade`: 30 submissions (the six solution notebooks, five times over,
each a fresh file), graded with --jobs 2; prints seconds per submission (target < 5 s).

    python benchmarks/bench_grading.py [--n 30] [--jobs 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from qlab.grading.grader import GradeOptions, grade_many

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 5.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=30, help="number of submissions")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--keep", default=None, help="keep submissions and grades in this folder")
    args = p.parse_args(argv)

    sources = sorted((ROOT / "solutions").glob("*.ipynb"))
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="qlab-bench-"))
    subs, out = work / "submissions", work / "out"
    shutil.rmtree(subs, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    subs.mkdir(parents=True)
    for i in range(args.n):
        src = sources[i % len(sources)]
        nb = nbformat.read(str(src), as_version=4)
        nbformat.write(nb, str(subs / f"student{i:03d}_{src.stem}.ipynb"))

    start = time.perf_counter()
    rows = grade_many([subs], out, jobs=args.jobs, opts=GradeOptions(timeout=args.timeout, seed=1))
    wall = time.perf_counter() - start
    full = sum(r["total"] == r["max"] > 0 for r in rows.values())
    per = wall / args.n
    inner = sorted(r.get("seconds", 0.0) for r in rows.values())
    result = {
        "submissions": args.n,
        "jobs": args.jobs,
        "wall_s": round(wall, 2),
        "seconds_per_submission": round(per, 2),
        "median_kernel_s_per_submission": inner[len(inner) // 2],
        "full_marks": full,
        "target_s": TARGET_S,
    }
    print(json.dumps(result, indent=1))
    print(
        f"{per:.2f} s per submission with --jobs {args.jobs} "
        f"({'within' if per < TARGET_S else 'OVER'} the {TARGET_S:g} s target)"
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if full == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
