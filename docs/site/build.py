"""Build the course website: execute the chapters, stage them with the docs, run Sphinx.

    python docs/site/build.py [--out site] [--jobs N] [--only 00 07] [--solutions]
                              [--executed DIR]

1. Execute every ``notebooks/NN_*.ipynb`` with nbclient in a fresh kernel whose working
   directory is ``notebooks/`` (as the tests' nbval run has it), with the
   ``qlab_static_widgets`` extension loaded so widgets carry a static picture. A chapter
   that fails stops the build, naming the chapter, the cell and the error. With
   ``--executed DIR``, a chapter already executed there (by tests/notebooks, whose run
   is this one) is taken as it is when its cells are the chapter's own.
2. Stage a Sphinx source tree that mirrors the repository (``notebooks/``,
   ``exercises/``, ``docs/``, and ``index.md`` made from the README's introduction and
   course map): executed chapters, exercise statements as committed (stubs, no
   outputs), solutions only with ``--solutions``. Each page gets a banner with its
   source and how to open it live; links to repository files that are not pages go to
   the repository (or become plain text when no repository URL is known).
3. ``sphinx-build`` with MyST-NB (``docs/site/conf.py``) renders it to ``--out``.

The repository URL for the source/Binder/Colab links comes from ``QLAB_REPO_URL``
(the publishing workflow sets it), else from ``git remote get-url origin``.
See docs/SITE.md for why Sphinx + MyST-NB and what the site costs to build.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from qlab._tensor import thread_count, thread_env

SITE_DIR = Path(__file__).resolve().parent  # docs/site: conf.py, this script, the extension
REPO = SITE_DIR.parents[1]
NUMBERED = re.compile(r"^(\d\d)_.+\.ipynb$")  # notebooks/00_why_quantization.ipynb etc.
CELL_TIMEOUT_S = 300  # as the tests' nbval run (--nbval-cell-timeout=300)
# docs/ pages in the order the site's Reference section lists them; others follow by name
DOC_ORDER = ("LEARNERS", "GLOSSARY", "INSTRUCTORS", "KERNELS", "SITE", "CONTRACT")
MD_LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s]+)\)")  # [text](target), not images


class BuildError(RuntimeError):
    """The site could not be built; the message says which chapter or step and why."""


@dataclass
class Repo:
    """Where the sources are and where links to them point."""

    root: Path
    url: str | None  # e.g. https://github.com/owner/qlab (no trailing slash)
    branch: str = "main"

    def blob(self, path: str) -> str | None:
        """Link to a file (or folder) of the repository, None without a URL."""
        if not self.url:
            return None
        kind = "tree" if (self.root / path).is_dir() else "blob"
        return f"{self.url}/{kind}/{self.branch}/{path}"


def repo_url(root: Path) -> str | None:
    """QLAB_REPO_URL, else the git remote `origin` when it is an https GitHub URL."""
    url = os.environ.get("QLAB_REPO_URL", "").strip()
    if not url:
        out = subprocess.run(
            ["git", "-C", str(root), "remote", "get-url", "origin"],
            capture_output=True,
            text=True,
        )
        url = out.stdout.strip() if out.returncode == 0 else ""
        url = re.sub(r"^git@github\.com:", "https://github.com/", url)
    url = url.rstrip("/").removesuffix(".git")
    return url if url.startswith("https://") else None


def numbered(folder: Path, only: list[str] | None = None) -> list[Path]:
    """``folder/NN_*.ipynb`` in order; ``only`` keeps the listed NN prefixes."""
    paths = sorted(p for p in folder.glob("*.ipynb") if NUMBERED.match(p.name))
    if only:
        paths = [p for p in paths if p.name[:2] in only]
    return paths


# ---------------------------------------------------------------- 1. execute


def execute(
    path: Path,
    timeout: int = CELL_TIMEOUT_S,
    threads: int | None = None,
    environ: dict[str, str] | None = None,
) -> nbformat.NotebookNode:
    """Run ``path`` top to bottom in a fresh kernel (cwd = its folder); return it with outputs.

    The kernel gets qlab's thread policy (qlab/_tensor.py ``thread_env``): ``threads``
    torch threads (default: the CPUs this process may use, or the user's OMP_NUM_THREADS)
    that sleep rather than spin while they wait. ``environ``: the environment the kernel
    starts from, before that policy and PYTHONPATH are applied (the policy's OMP_* values
    are still read from os.environ, one key at a time; default os.environ; a
    caller whose main thread may change os.environ meanwhile passes a copy taken there:
    copying os.environ key by key can meet a key just removed). Raises BuildError naming
    the notebook and the cell when a cell fails, times out or the kernel dies.
    """
    nb = nbformat.read(path, as_version=4)
    base = dict(os.environ if environ is None else environ)
    env = dict(
        base,
        **thread_env(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [str(SITE_DIR), base.get("PYTHONPATH", "")])),
    )
    with tempfile.TemporaryDirectory(prefix="qlab-site-kernel-") as sockets:
        # Unix sockets in a private folder (jupyter_client's ipc transport), not TCP ports
        km = AsyncKernelManager(kernel_name="python3", transport="ipc", ip=f"{sockets}/k")
        client = NotebookClient(
            nb,
            km=km,
            timeout=timeout,
            resources={"metadata": {"path": str(path.parent)}},
            store_widget_state=False,  # the static page shows pictures, not live widget state
            extra_arguments=["--IPKernelApp.extensions=qlab_static_widgets"],
        )
        _run(client, env, path)
    return nb


def _run(client: NotebookClient, env: dict, path: Path) -> None:
    """client.execute, with a failure turned into a BuildError that names the chapter."""
    nb = client.nb
    try:
        # a fresh event loop per notebook, closed at the end (each runs in its own thread);
        # cleanup_kc: shut the kernel down, which nbclient leaves to whoever passed km
        asyncio.run(client.async_execute(env=env, cleanup_kc=True))
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        cell = _failed_cell(nb)
        where = f"cell {cell}" if cell is not None else "a cell"
        raise BuildError(
            f"chapter {path.stem} failed to execute ({where}): {_tail(str(e))}\n"
            f"run it alone to see why: python -m pytest {os.path.relpath(path)} "
            "--nbval-lax --nbval-current-env"
        ) from e


def _failed_cell(nb: nbformat.NotebookNode) -> int | None:
    """Index of the first code cell with an error output (None if none has one)."""
    for i, cell in enumerate(nb.cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return i
    return None


def _tail(message: str, lines: int = 12) -> str:
    """The last lines of an nbclient error (the exception itself), ANSI colours removed."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", message).strip().splitlines()
    return "\n".join(plain[-lines:])


def execute_all(
    paths: list[Path], jobs: int, root: Path = REPO
) -> dict[str, nbformat.NotebookNode]:
    """Execute ``paths`` (``jobs`` at a time) -> {repo-relative path: executed notebook}.

    Every failure is reported, then BuildError. The threads are shared out: each of the
    ``jobs`` kernels gets thread_count() // jobs torch threads (at least 1).
    """
    results, failures = {}, []
    threads = None if jobs <= 1 else max(1, thread_count() // jobs)

    def run(path: Path) -> None:
        start = time.monotonic()
        try:
            results[path.relative_to(root).as_posix()] = execute(path, threads=threads)
            print(f"  executed {path.name} in {time.monotonic() - start:.0f} s", flush=True)
        except BuildError as e:
            failures.append(str(e))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(run, paths))
    if failures:
        raise BuildError("\n\n".join(sorted(failures)))
    return results


def already_executed(
    paths: list[Path], folder: Path | None, root: Path = REPO
) -> tuple[dict[str, nbformat.NotebookNode], list[Path]]:
    """({repo-relative path: executed copy} for each of ``paths`` with a copy in ``folder``
    whose cells are its own, [the paths still to execute])."""
    done, rest = {}, []
    for path in paths:
        copy = folder / path.name if folder else None
        if copy and copy.is_file():
            nb = nbformat.read(copy, as_version=4)
            if _sources(nb) == _sources(nbformat.read(path, as_version=4)):
                done[path.relative_to(root).as_posix()] = nb
                continue
        rest.append(path)
    return done, rest


def _sources(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


# ---------------------------------------------------------------- 2. stage


def rewrite_links(text: str, src: str, pages: set[str], repo: Repo) -> str:
    """Point every relative markdown link of ``text`` (from repo file ``src``) somewhere real.

    A link to a staged page (``pages``: repo-relative paths) stays as it is, since the
    staged tree mirrors the repository (README.md is staged as index.md); a link to any
    other repository file goes to the repository, or becomes its text without a URL.
    """
    base = Path(src).parent

    def fix(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            return m.group(0)  # http:, mailto:, an anchor on the same page
        path, _, anchor = target.partition("#")
        norm = os.path.normpath(base / path).replace(os.sep, "/")
        if norm in pages:
            if norm == "README.md":  # the home page
                staged = os.path.relpath("index.md", base).replace(os.sep, "/")
                return f"[{label}]({staged}{'#' + anchor if anchor else ''})"
            return m.group(0)
        url = repo.blob(norm) if not norm.startswith("..") else None
        return f"[{label}]({url})" if url else label

    return MD_LINK.sub(fix, text)


def banner(kind: str, rel: str, repo: Repo) -> str:
    """The markdown note under a page's title: what the page is and how to open it live."""
    name = Path(rel).name
    source = repo.blob(rel)
    links = [f"[source]({source})"] if source else []
    if repo.url and repo.url.startswith("https://github.com/"):
        gh = repo.url.removeprefix("https://github.com/")
        links.append(
            f"[Binder](https://mybinder.org/v2/gh/{gh}/{repo.branch}?urlpath=lab/tree/{rel})"
        )
        links.append(
            f"[Colab](https://colab.research.google.com/github/{gh}/blob/{repo.branch}/{rel})"
        )
    online = (" · ".join(links) + ". ") if links else ""
    if kind == "chapter":
        return (
            "```{note}\nA read-only copy of this notebook, executed when the site was built. "
            f"{online}To run it yourself: `make lab` in a clone of the course, then open "
            f"`{rel}` in JupyterLab (see the home page's quick start).\n```"
        )
    work = rel if kind == "solution" else f"my_work/{name}"
    return (
        f"```{{note}}\nThe {kind} notebook as handed out, not executed. {online}To work it: "
        f"`make exercises` copies every exercise to `my_work/`; open `{work}` in JupyterLab "
        "and run its check cells. Solutions: `solutions/` in the repository.\n```"
    )


def stage_notebook(
    nb: nbformat.NotebookNode, kind: str, rel: str, pages: set[str], repo: Repo
) -> nbformat.NotebookNode:
    """A copy of ``nb`` with links rewritten and the banner right under its title."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = rewrite_links(cell.source, rel, pages, repo)
    at = 0
    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "markdown" and first.source.startswith("# "):
        title, _, rest = first.source.partition("\n")  # split the title off its cell
        first.source = title
        if rest.strip():
            nb.cells.insert(1, nbformat.v4.new_markdown_cell(rest.strip("\n")))
        at = 1
    nb.cells.insert(at, nbformat.v4.new_markdown_cell(banner(kind, rel, repo)))
    return nb


def section(markdown: str, heading: str) -> str:
    """The ``## heading`` section of ``markdown`` (heading line included) up to the next ``## ``."""
    m = re.search(rf"^## {re.escape(heading)}\s*$.*?(?=^## |\Z)", markdown, re.M | re.S)
    if not m:
        raise BuildError(f"README.md has no '## {heading}' section for the home page")
    return m.group(0).rstrip() + "\n"


HOME_SECTIONS = ("The course", "Quick start")  # README sections on the home page, in order


def home_page(readme: str, toc: dict[str, list[str]]) -> str:
    """index.md: the README's title and introduction, its course map and quick start, the toc."""
    intro = readme.split("\n## ", 1)[0].rstrip() + "\n"
    parts = [intro] + [section(readme, name) for name in HOME_SECTIONS]
    for caption, entries in toc.items():
        if entries:
            body = "\n".join(entries)
            parts.append(f"```{{toctree}}\n:caption: {caption}\n:hidden:\n\n{body}\n```\n")
    return "\n".join(parts)


def doc_pages(root: Path) -> list[str]:
    """docs/*.md in DOC_ORDER first, the rest by name (repo-relative paths)."""
    names = sorted(p.stem for p in (root / "docs").glob("*.md"))
    ordered = [n for n in DOC_ORDER if n in names] + [n for n in names if n not in DOC_ORDER]
    return [f"docs/{n}.md" for n in ordered]


def stage(
    repo: Repo,
    dest: Path,
    executed: dict[str, nbformat.NotebookNode],
    solutions: bool = False,
) -> list[str]:
    """Write the Sphinx source tree into ``dest``; returns the staged repo-relative pages.

    ``executed`` holds the executed chapters (and solutions) by repo-relative path;
    exercises (and solutions not in it) are staged as committed.
    """
    root = repo.root
    chapters = sorted(rel for rel in executed if rel.startswith("notebooks/"))
    exercises = [f"exercises/{p.name}" for p in numbered(root / "exercises")]
    sols = [f"solutions/{p.name}" for p in numbered(root / "solutions")] if solutions else []
    docs = doc_pages(root)
    pages = {"README.md", *chapters, *exercises, *sols, *docs}
    if dest.exists():
        shutil.rmtree(dest)
    kinds = {"notebooks": "chapter", "exercises": "exercise", "solutions": "solution"}
    for rel in chapters + exercises + sols:
        nb = executed.get(rel) or nbformat.read(root / rel, as_version=4)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(stage_notebook(nb, kinds[rel.split("/")[0]], rel, pages, repo), out)
    for rel in docs:
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(rewrite_links((root / rel).read_text(), rel, pages, repo))
    toc = {
        "Chapters": chapters,
        "Exercises": exercises,
        "Solutions": sols,
        "Guides and reference": docs,
    }
    toc = {k: [Path(v).with_suffix("").as_posix() for v in vs] for k, vs in toc.items()}
    readme = rewrite_links((root / "README.md").read_text(), "README.md", pages, repo)
    (dest / "index.md").write_text(home_page(readme, toc))
    return sorted(pages)


# ---------------------------------------------------------------- 3. render


def sphinx(src: Path, out: Path, doctrees: Path, repo: Repo) -> None:
    """sphinx-build -W (warnings fail the build: a broken link is a warning)."""
    env = dict(os.environ, QLAB_REPO_URL=repo.url or "", QLAB_REPO_BRANCH=repo.branch)
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-b",
        "html",
        "-c",
        str(SITE_DIR),
        "-W",
        "--keep-going",
        "-q",
        "-d",
        str(doctrees),
        str(src),
        str(out),
    ]
    if subprocess.run(cmd, env=env).returncode != 0:
        raise BuildError("sphinx-build failed (its warnings and errors are above)")


def build(
    out: Path,
    work: Path,
    jobs: int = 1,
    only: list[str] | None = None,
    solutions: bool = False,
    root: Path = REPO,
    executed_dir: Path | None = None,
) -> list[str]:
    """The whole build (execute, stage, render); returns the staged pages."""
    repo = Repo(root, repo_url(root), os.environ.get("QLAB_REPO_BRANCH", "main"))
    chapters = numbered(root / "notebooks", only)
    if not chapters:
        raise BuildError(f"no notebooks/NN_*.ipynb found under {root} (--only {only})")
    wanted = chapters + (numbered(root / "solutions", only) if solutions else [])
    executed, to_run = already_executed(wanted, executed_dir, root)
    start = time.monotonic()
    if executed:
        print(f"{len(executed)} notebook(s) taken as executed in {executed_dir}", flush=True)
    print(f"executing {len(to_run)} notebook(s), {jobs} at a time ...", flush=True)
    executed |= execute_all(to_run, jobs, root)
    print(f"executed in {time.monotonic() - start:.0f} s; rendering ...", flush=True)
    pages = stage(repo, work / "src", executed, solutions)
    sphinx(work / "src", out, work / "doctrees", repo)
    print(f"site built in {time.monotonic() - start:.0f} s: {out / 'index.html'}", flush=True)
    return pages


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="site", help="output folder (default: site)")
    p.add_argument("--work", default="build/site", help="staging folder (default: build/site)")
    p.add_argument("--jobs", type=int, default=1, help="chapters executed at once (default 1)")
    p.add_argument("--only", nargs="+", metavar="NN", help="only these chapters, e.g. 00 07")
    p.add_argument("--solutions", action="store_true", help="also publish solutions/ (executed)")
    p.add_argument(
        "--executed",
        type=Path,
        metavar="DIR",
        help="take chapters already executed in DIR (by the tests) when their cells match",
    )
    args = p.parse_args(argv)
    try:
        build(
            Path(args.out),
            Path(args.work),
            args.jobs,
            args.only,
            args.solutions,
            executed_dir=args.executed,
        )
    except BuildError as e:
        print(f"make site: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
