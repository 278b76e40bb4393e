"""The ``qlab`` command. Subcommands register themselves in ``_COMMANDS``.

    qlab assign [--source solutions] [--dest exercises] [--check]
    qlab grade SUBMISSION... --out DIR [--jobs N] [--timeout S] [--wall S] [--mem-mb MB]
               [--procs N] [--disk-mb MB] [--seed N] [--assignment NAME] [--env KEY=VALUE]
               [--sandbox auto|on|off] [--shard I/N] [--forbid-reference]
    qlab grade merge DIR... --out DIR     (combine the results of --shard runs; similarity)

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
    from qlab.grading.grader import GradeOptions, grade_many, parse_shard

    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"--env takes KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        env[key] = value
    try:
        shard = parse_shard(args.shard) if args.shard else None
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if shard and not args.seed:
        print(
            "--shard needs --seed: every shard must draw inputs from the same run seed "
            "(e.g. --seed 20260901)",
            file=sys.stderr,
        )
        return 2
    opts = GradeOptions(
        timeout=args.timeout,
        wall=args.wall,
        mem_mb=args.mem_mb,
        procs=args.procs,
        disk_mb=args.disk_mb,
        forbid_reference=args.forbid_reference,
        seed=args.seed,
        assignment=args.assignment,
        env=env,
        sandbox=args.sandbox,
    )
    missing = [p for p in args.submissions if not Path(p).exists()]
    if missing:
        print(f"no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        rows = grade_many(
            args.submissions, args.out, args.jobs, opts, progress=not args.quiet, shard=shard
        )
    except (RuntimeError, ValueError) as e:  # --sandbox on without bwrap; hidden folders
        print(f"qlab grade: {e}", file=sys.stderr)
        return 2
    where = f"{args.out}/shard-{shard[0]}-of-{shard[1]}" if shard else args.out
    if not rows and shard:  # a small class leaves some slices empty: not an error
        print(f"no submissions fall in shard {args.shard}; wrote an empty {where}/grades.json")
        return 0
    if not rows:
        print("no notebooks (*.ipynb) found to grade", file=sys.stderr)
        return 1
    print(f"graded {len(rows)} submission(s) -> {where}/grades.csv, grades.json")
    for k, r in sorted(rows.items()):
        if r.status != "graded" or r.flags:
            print(f"  {k} [{r.status}]: " + "; ".join([*r.flags, *r.log])[:500], file=sys.stderr)
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from qlab.grading.grader import merge

    try:
        info = merge(args.folders, args.out)
    except ValueError as e:
        print(f"qlab grade merge: {e}", file=sys.stderr)
        return 2
    print(
        f"merged {len(info['merged_from'])} result(s), {info['rows']} submission(s) -> "
        f"{args.out}/grades.csv, grades.json; similarity.csv: {info['pairs']} pair(s)"
    )
    if info["similarity_skipped"]:
        skipped = ", ".join(info["similarity_skipped"][:10])
        print(
            f"  similarity.csv leaves out {len(info['similarity_skipped'])} submission(s) whose "
            f"file is gone or changed since it was graded: {skipped}",
            file=sys.stderr,
        )
    return 0


def _add_merge(sub) -> None:
    p = sub.add_parser(
        "grade-merge",
        help="combine the results of `qlab grade --shard` runs (also: qlab grade merge)",
        description="Find every grades.json under the folders (one per shard) and write "
        "OUT/grades.json and OUT/grades.csv. All shards of the run must be there. "
        "OUT/similarity.csv is computed again over every merged submission, from the "
        "files the rows name (a file gone or changed since grading is left out).",
    )
    p.add_argument("folders", nargs="+", help="folders holding the shards' results")
    p.add_argument("--out", required=True, help="folder for the merged grades")
    p.set_defaults(func=_cmd_merge)


def _add_grade(sub) -> None:
    p = sub.add_parser(
        "grade",
        help="grade submitted notebooks",
        description="Run each notebook in a sandboxed kernel, call its "
        "functions on fresh inputs, compare with qlab. Writes DIR/grades.csv "
        "and DIR/grades.json; re-running resumes (graded files are skipped). "
        "`qlab grade merge DIR... --out DIR` combines the results of --shard runs.",
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
        help="memory of one submission's processes together, and address space of each, "
        "in MiB (default 4096)",
    )
    p.add_argument(
        "--procs",
        type=int,
        default=256,
        help="processes and threads of one submission together (default 256)",
    )
    p.add_argument(
        "--disk-mb",
        type=int,
        default=1024,
        help="MiB of files one submission may write (default 1024)",
    )
    p.add_argument(
        "--forbid-reference",
        action="store_true",
        help="score 0 a task whose function calls the qlab function the task asks for, or "
        "the grader's reference (default: graded on its results, flagged in uses_reference)",
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
        help="assignment name, e.g. 01_affine (default: from the file name, else the "
        "notebook metadata)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the grading kernels (repeatable)",
    )
    _add_grade_isolation(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_grade)


def _add_grade_isolation(p) -> None:
    p.add_argument(
        "--sandbox",
        choices=("auto", "on", "off"),
        default="auto",
        help="isolate each kernel with bubblewrap: auto (when bwrap works here, else warn "
        "and grade without), on (stop if it does not work), off (default auto)",
    )
    p.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="grade only slice I of N (by a hash of each submission's name) into "
        "OUT/shard-I-of-N/; needs --seed; combine with `qlab grade merge`",
    )


_COMMANDS = [_add_assign, _add_grade, _add_merge]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qlab", description="qlab course tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["grade", "merge"]:  # `qlab grade merge` = `qlab grade-merge`
        argv = ["grade-merge", *argv[2:]]
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
