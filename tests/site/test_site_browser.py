"""The course website, built for real and read in Chromium (issue 17).

Builds the whole site once (docs/site/build.py, the script `make site` runs: every
chapter executed with nbclient, then Sphinx + MyST-NB) into a temporary folder, serves
it on 127.0.0.1, and checks as a reader would:

- every page (all reachable from the home page) loads with no console error, no page
  error, no failed request and no HTTP error, MathJax included;
- every chapter notebooks/NN_*.ipynb has a page with at least one figure that rendered
  (an <img> in its outputs with a real width; NO_FIGURE_YET lists the chapters that plot
  nothing yet), and every widget output is a static picture of several states with the
  note about JupyterLab;
- every internal link resolves: the file exists and so does the #anchor on it;
- every exercise has a page, no solution does; the search box finds a term;
- the pages link to the repository, Binder and Colab (QLAB_REPO_URL is set to a
  placeholder for the build: external links are checked for form, not followed).

QLAB_SITE_DIR=<dir>/site checks an existing build instead (faster while developing; build
it with `docs/site/build.py --out <dir>/site --work <dir>/work`, QLAB_REPO_URL set to
FAKE_REPO for the link test).
Needs Chromium (apt-get install -y chromium) and playwright, like
tests/notebooks/test_browser.py: skipped on a workstation without them, FAILS when
CI=true.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("QLAB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
]
BUILD_TIMEOUT_S = 1800  # every chapter executed once on a busy 2-core machine, then Sphinx
PAGE_TIMEOUT_S = 60
FAKE_REPO = "https://github.com/example/qlab"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# Chapters that plot nothing yet (none: every chapter draws a figure). Each must still
# have no figure: the test fails as soon as one gains a figure, so it leaves this list.
NO_FIGURE_YET: set[str] = set()


def _missing(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the site's browser test must run in CI)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def site(tmp_path_factory, executed_chapters) -> tuple[Path, Path | None]:
    """(built site folder, its staged source folder or None when QLAB_SITE_DIR is given).

    Chapters that tests/notebooks/test_chapters.py executed earlier in this session are
    taken from there (the same run); the build executes the others."""
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        _missing(f"Chromium not found at {CHROMIUM}: apt-get install -y chromium")
    given = os.environ.get("QLAB_SITE_DIR")
    if given:  # built with --out <dir>/site --work <dir>/work, like below
        src = Path(given).parent / "work" / "src"
        return Path(given), src if src.is_dir() else None
    tmp = tmp_path_factory.mktemp("site")
    env = dict(os.environ, QLAB_REPO_URL=FAKE_REPO, QLAB_REPO_BRANCH="main")
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "docs" / "site" / "build.py"),
            "--out",
            str(tmp / "site"),
            "--work",
            str(tmp / "work"),
            "--executed",
            str(executed_chapters),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert out.returncode == 0, f"make site failed:\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    print(out.stdout)  # the time of each chapter (pytest -s or -rP shows it)
    print(f"site built in {time.monotonic() - start:.0f} s")
    return tmp / "site", tmp / "work" / "src"


@pytest.fixture(scope="module")
def server(site):
    """The site over HTTP on 127.0.0.1 (as a static host serves it); yields the base URL."""
    root = site[0]

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=root))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


class _Page(HTMLParser):
    """The ids and the link targets of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


def _internal_pages(root: Path) -> dict[str, _Page]:
    """Every HTML page reachable from index.html through internal links, parsed."""
    pages, todo = {}, ["index.html"]
    while todo:
        rel = todo.pop()
        if rel in pages or not (root / rel).is_file():
            continue
        pages[rel] = _parse(root / rel)
        for href in pages[rel].links:
            target = urlsplit(urljoin(f"http://site/{rel}", href))
            if target.netloc == "site" and target.path.endswith(".html"):
                todo.append(unquote(target.path.lstrip("/")))
    return pages


def test_internal_links_resolve(site):
    root = site[0]
    pages = _internal_pages(root)
    broken = []
    for rel, page in pages.items():
        for href in page.links:
            target = urlsplit(urljoin(f"http://site/{rel}", href))
            if target.netloc != "site":
                continue  # external: Binder, Colab, the repository
            path = unquote(target.path.lstrip("/")) or "index.html"
            if path.endswith("/"):
                path += "index.html"
            if not (root / path).exists():
                broken.append(f"{rel}: {href} (no file {path})")
            elif target.fragment and path.endswith(".html"):
                ids = pages[path].ids if path in pages else _parse(root / path).ids
                if target.fragment not in ids:
                    broken.append(f"{rel}: {href} (no #{target.fragment} on {path})")
    assert not broken, "broken internal links:\n" + "\n".join(sorted(set(broken))[:40])
    assert len(pages) >= 20


def test_every_chapter_and_exercise_has_a_page(site):
    root = site[0]
    for folder in ("notebooks", "exercises"):
        for nb in sorted((REPO / folder).glob("[0-9][0-9]_*.ipynb")):
            assert (root / folder / f"{nb.stem}.html").is_file(), f"no page for {folder}/{nb.name}"
    assert not (root / "solutions").exists(), "solutions are published only with --solutions"
    home = (root / "index.html").read_text()
    assert "Quick start" in home and "The course" in home


def test_pages_link_to_the_repository_binder_and_colab(site):
    page = (site[0] / "notebooks" / "02_granularity.html").read_text()
    assert f"{FAKE_REPO}/blob/main/notebooks/02_granularity.ipynb" in page
    assert (
        "https://mybinder.org/v2/gh/example/qlab/main?urlpath=lab/tree/notebooks/"
        "02_granularity.ipynb" in page
    )
    assert (
        "https://colab.research.google.com/github/example/qlab/blob/main/notebooks/"
        "02_granularity.ipynb" in page
    )


def _widget_outputs(src: Path) -> dict[str, int]:
    """{page: number of widget outputs} from the staged (executed) chapters."""
    counts = {}
    for nb_path in sorted((src / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        n = 0
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if WIDGET_VIEW in data:
                    n += 1
                    assert 'class="qlab-static-widget"' in data.get("text/html", ""), (
                        f"{nb_path.name}: a widget output without its static picture"
                    )
        counts[f"notebooks/{nb_path.stem}.html"] = n
    return counts


def test_pages_in_chromium(site, server):
    """Every page: no console error; chapters: figures rendered; widgets: static pictures."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the Python package playwright is not installed: pip install playwright")
    root, src = site
    pages = sorted(_internal_pages(root))
    widgets = _widget_outputs(src) if src else {}
    assert widgets == {} or sum(widgets.values()) >= 3  # 00, 02, 04, 05 display widgets
    problems, figures = [], {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            current = {"rel": ""}
            page.on(
                "console",
                lambda m: (
                    m.type == "error"
                    and problems.append(f"{current['rel']}: console error: {m.text}")
                ),
            )
            page.on("pageerror", lambda e: problems.append(f"{current['rel']}: page error: {e}"))
            page.on(
                "requestfailed",
                lambda r: problems.append(f"{current['rel']}: request failed: {r.url}"),
            )
            page.on(
                "response",
                lambda r: (
                    r.status >= 400
                    and problems.append(f"{current['rel']}: HTTP {r.status}: {r.url}")
                ),
            )
            for rel in pages:
                current["rel"] = rel
                page.goto(server + rel, wait_until="networkidle", timeout=PAGE_TIMEOUT_S * 1000)
                if page.locator(".math").count():  # MathJax typeset the page's math
                    page.wait_for_function(
                        "() => window.MathJax && MathJax.Hub && MathJax.Hub.queue.pending === 0"
                        " && document.querySelectorAll('.MathJax, .MathJax_Display').length > 0",
                        timeout=PAGE_TIMEOUT_S * 1000,
                    )
                    if page.locator(".MathJax_Error, merror").count():
                        problems.append(f"{rel}: MathJax could not typeset some math")
                if rel.startswith("notebooks/"):
                    figures[rel] = page.evaluate(
                        "() => [...document.querySelectorAll('.cell_output img, "
                        ".qlab-static-widget img')].filter(i => i.complete && i.naturalWidth > 50)"
                        ".length"
                    )
                    static = page.locator(".qlab-static-widget")
                    if widgets.get(rel):
                        assert static.count() == widgets[rel], rel
                        assert static.first.locator(".qlab-static-state").count() >= 3, rel
                        assert "JupyterLab" in static.first.inner_text(), rel
                    assert "widget-view" not in page.inner_text("main"), rel
            # the search box finds a term of the course
            current["rel"] = "search.html"
            page.goto(server + "search.html?q=microscaling", wait_until="networkidle")
            page.wait_for_selector("#search-results li", timeout=PAGE_TIMEOUT_S * 1000)
            hits = page.locator("#search-results li a").all_inner_texts()
            assert any("05" in h or "Microscaling" in h for h in hits), hits
        finally:
            browser.close()
    assert not problems, "\n".join(problems[:40])
    chapters = {f"notebooks/{p.stem}.html" for p in REPO.glob("notebooks/[0-9][0-9]_*.ipynb")}
    assert chapters <= set(figures), f"chapter pages not reached: {chapters - set(figures)}"
    no_figure = {rel for rel in chapters if figures[rel] < 1}
    assert no_figure <= NO_FIGURE_YET, f"chapter pages without a rendered figure: {no_figure}"
    gained = (NO_FIGURE_YET & chapters) - no_figure
    assert not gained, f"{sorted(gained)} now show a figure: remove them from NO_FIGURE_YET"
