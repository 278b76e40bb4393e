"""The ``qlab`` command. Subcommands register themselves in ``_COMMANDS``.

    qlab assign [--source solutions] [--dest exercises] [--check]
    qlab grade SUBMISSION... --out DIR [--jobs N] [--timeout S] [--wall S] [--mem-mb MB]
               [--seed N] [--assignment NAME] [--env KEY=VALUE]

To add a subcommand (e.g. ``bench``): write ``_add_bench(sub)`` that creates its parser
with ``set_defaults(func=...)`` and append it to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _cmd_assign(args: argparse.Namespace) -> int:
    from qlab.grading.notebook import assign_dir

    changed = assign_dir(Path(args.source), Path(args.dest), check=args.check)
    if args.check:
        if changed:
            print(
                f"{args.dest}/ is out of date with {args.source}/: "
                + ", ".join(changed)
                + "\nrun `qlab assign` to regenerate it",
                file=sys.stderr,
            )
            return 1
        print(f"{args.dest}/ is up to date")
        return 0
    print(
        f"wrote {len(changed)} notebook(s) to {args.dest}/"
        + (": " + ", ".join(changed) if changed else " (all up to date)")
    )
    return 0


def _add_assign(sub) -> None:
    p = sub.add_parser(
        "assign",
        help="generate exercises/ from solutions/",
        description="Replace solution regions by stubs, strip outputs, lock test cells.",
    )
    p.add_argument("--source", default="solutions", help="folder of solution notebooks")
    p.add_argument("--dest", default="exercises", help="folder to write exercises to")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if DEST differs from what would be generated",
    )
    p.set_defaults(func=_cmd_assign)


def _cmd_grade(args: argparse.Namespace) -> int:
    from qlab.grading.grader import GradeOptions, grade_many

    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"--env takes KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        env[key] = value
    opts = GradeOptions(
        timeout=args.timeout,
        wall=args.wall,
        mem_mb=args.mem_mb,
        seed=args.seed,
        assignment=args.assignment,
        env=env,
    )
    missing = [p for p in args.submissions if not Path(p).exists()]
    if missing:
        print(f"no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = grade_many(
        args.submissions, args.out, jobs=args.jobs, opts=opts, progress=not args.quiet
    )
    if not rows:
        print("no notebooks (*.ipynb) found to grade", file=sys.stderr)
        return 1
    errors = [k for k, r in rows.items() if r.get("status") != "graded"]
    print(f"graded {len(rows)} submission(s) -> {args.out}/grades.csv, grades.json")
    for k in errors:
        print(f"  {k}: " + "; ".join(rows[k].get("log", [])), file=sys.stderr)
    return 0


def _add_grade(sub) -> None:
    p = sub.add_parser(
        "grade",
        help="grade submitted notebooks",
        description="Run each notebook in a sandboxed kernel, call its "
        "functions on fresh inputs, compare with qlab. Writes DIR/grades.csv "
        "and DIR/grades.json; re-running resumes (graded files are skipped).",
    )
    p.add_argument("submissions", nargs="+", help="notebooks or folders of notebooks")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--jobs", type=int, default=1, help="submissions graded in parallel")
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds per cell and per task call (default 30)",
    )
    p.add_argument(
        "--wall", type=float, default=300.0, help="seconds per submission in all (default 300)"
    )
    p.add_argument(
        "--mem-mb",
        type=int,
        default=4096,
        help="address-space limit of each kernel in MiB (default 4096)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="run seed (default: random, or the one in an existing grades.json)",
    )
    p.add_argument(
        "--assignment",
        default=None,
        help="assignment name, e.g. 01_affine (default: from the notebook)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the grading kernels (repeatable)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_grade)


_COMMANDS = [_add_assign, _add_grade]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qlab", description="qlab course tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
