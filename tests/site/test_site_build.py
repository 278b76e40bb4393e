"""The website build's parts, without building the whole site (docs/site/build.py).

Fast checks: which notebooks become pages, links, the home page from the README, the
banner's live links, a failing chapter named in the error, and the widgets' static
pictures. tests/site/test_site_browser.py builds the real site and reads it in Chromium.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
SITE_DIR = REPO / "docs" / "site"


def _load(name: str, file: str):
    """Import docs/site/<file> (not a package: the build runs it as a script)."""
    spec = importlib.util.spec_from_file_location(name, SITE_DIR / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


build = _load("qlab_site_build", "build.py")
static_widgets = _load("qlab_static_widgets", "qlab_static_widgets.py")
GH = build.Repo(REPO, "https://github.com/example/qlab", "main")


def test_every_numbered_notebook_is_a_chapter():
    found = [p.name for p in build.numbered(REPO / "notebooks")]
    on_disk = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    # every notebooks/NN_*.ipynb, so chapters added later are picked up with no edit here
    assert found == [n for n in on_disk if re.match(r"^\d\d_", n)]
    assert found[0].startswith("00_") and len(found) >= 12
    assert [p.name[:2] for p in build.numbered(REPO / "notebooks", ["00", "02"])] == ["00", "02"]


def test_links_point_at_pages_or_the_repository():
    pages = {"README.md", "notebooks/00_a.ipynb", "docs/GLOSSARY.md", "exercises/01_b.ipynb"}
    fix = lambda text, src, repo=GH: build.rewrite_links(text, src, pages, repo)  # noqa: E731
    # a page: kept as written (the staged tree mirrors the repository)
    assert fix("[g](../docs/GLOSSARY.md#nf4)", "notebooks/00_a.ipynb") == (
        "[g](../docs/GLOSSARY.md#nf4)"
    )
    assert fix("[n](notebooks/00_a.ipynb)", "README.md") == "[n](notebooks/00_a.ipynb)"
    # the README is the home page
    assert fix("[r](../README.md#quick-start)", "docs/X.md") == "[r](../index.md#quick-start)"
    # any other file of the repository: a link to it there (file: blob, folder: tree)
    assert fix("[p](../qlab/packing.py)", "docs/X.md") == (
        "[p](https://github.com/example/qlab/blob/main/qlab/packing.py)"
    )
    assert fix("[s](solutions/)", "README.md") == (
        "[s](https://github.com/example/qlab/tree/main/solutions)"
    )
    # without a repository URL it becomes plain text, never a broken link
    no_url = build.Repo(REPO, None)
    assert fix("see [p](../qlab/packing.py).", "docs/X.md", no_url) == "see p."
    # external links, same-page anchors and images are left alone
    for keep in ("[w](https://example.org/a)", "[a](#top)", "![i](fig.png)"):
        assert fix(keep, "docs/X.md") == keep


def test_home_page_has_the_readme_course_map_and_a_toc():
    readme = (REPO / "README.md").read_text()
    home = build.home_page(readme, {"Chapters": ["notebooks/00_why_quantization"], "X": []})
    assert home.startswith(readme.split("\n")[0])  # the README's title
    for row in re.findall(r"^\| \[?\d\d .*$", readme, re.M):  # every row of the course map
        assert row in home
    assert ":caption: Chapters" in home and ":caption: X" not in home  # empty sections dropped
    assert "## Quick start" in home and "make lab" in home
    with pytest.raises(build.BuildError, match="The course"):
        build.home_page("# t\n\n## Other\n", {})


def test_banner_says_how_to_open_the_page_live():
    chapter = build.banner("chapter", "notebooks/02_granularity.ipynb", GH)
    assert (
        "https://mybinder.org/v2/gh/example/qlab/main?urlpath=lab/tree/notebooks/"
        "02_granularity.ipynb" in chapter
    )
    assert (
        "https://colab.research.google.com/github/example/qlab/blob/main/notebooks/"
        "02_granularity.ipynb" in chapter
    )
    assert "https://github.com/example/qlab/blob/main/notebooks/02_granularity.ipynb" in chapter
    assert "`make lab`" in chapter
    exercise = build.banner("exercise", "exercises/01_affine.ipynb", GH)
    assert "`make exercises`" in exercise and "my_work/01_affine.ipynb" in exercise
    offline = build.banner("chapter", "notebooks/02_granularity.ipynb", build.Repo(REPO, None))
    assert "http" not in offline and "`make lab`" in offline


def test_repo_url_from_the_environment_or_git(monkeypatch, tmp_path):
    monkeypatch.setenv("QLAB_REPO_URL", "https://github.com/o/r.git/")
    assert build.repo_url(tmp_path) == "https://github.com/o/r"
    monkeypatch.setenv("QLAB_REPO_URL", "")
    assert build.repo_url(tmp_path) is None  # not a git repository: no URL, no broken links


def _stage_fake_repo(root: Path, cells: list[str]) -> None:
    (root / "notebooks").mkdir(parents=True)
    (root / "exercises").mkdir()
    (root / "solutions").mkdir()
    (root / "docs").mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 98 · A chapter\nIntro of 98.")] + [
        nbformat.v4.new_code_cell(c) for c in cells
    ]
    nbformat.write(nb, root / "notebooks" / "98_fine.ipynb")
    ex = nbformat.v4.new_notebook()
    ex.cells = [nbformat.v4.new_markdown_cell("# Exercise 98"), nbformat.v4.new_code_cell("1")]
    nbformat.write(ex, root / "exercises" / "98_fine.ipynb")
    nbformat.write(ex, root / "solutions" / "98_fine.ipynb")
    (root / "docs" / "GLOSSARY.md").write_text("# Glossary\n\nsee [the start](../README.md)\n")
    (root / "README.md").write_text(
        "# Course\n\nIntro.\n\n## Quick start\n\nmake lab\n\n## The course\n\n| a | b |\n"
        "| - | - |\n| [98 A chapter](notebooks/98_fine.ipynb) | x |\n\n## More\n\nend\n"
    )


def test_a_failing_chapter_fails_the_build_and_is_named(tmp_path):
    _stage_fake_repo(tmp_path, ["x = 1"])
    bad = nbformat.v4.new_notebook()
    bad.cells = [
        nbformat.v4.new_markdown_cell("# 99"),
        nbformat.v4.new_code_cell("y = 2"),
        nbformat.v4.new_code_cell("assert y == 3, 'the figure changed'"),
    ]
    nbformat.write(bad, tmp_path / "notebooks" / "99_broken.ipynb")
    with pytest.raises(build.BuildError) as err:
        build.execute_all(build.numbered(tmp_path / "notebooks"), jobs=2, root=tmp_path)
    message = str(err.value)
    assert "chapter 99_broken failed to execute (cell 2)" in message
    assert "AssertionError: the figure changed" in message
    assert "98_fine" not in message  # the chapter that ran is not blamed


def test_a_chapter_executed_by_the_tests_is_taken_only_while_its_cells_are_the_same(tmp_path):
    root, done = tmp_path / "repo", tmp_path / "executed"
    _stage_fake_repo(root, ["print('hi')"])
    done.mkdir()
    chapters = build.numbered(root / "notebooks")
    assert build.already_executed(chapters, done, root) == ({}, chapters)  # none there yet
    ran = build.execute_all(chapters, 1, root)["notebooks/98_fine.ipynb"]
    nbformat.write(ran, done / "98_fine.ipynb")
    taken, rest = build.already_executed(chapters, done, root)
    assert rest == [] and taken["notebooks/98_fine.ipynb"].cells[1].outputs[0]["text"] == "hi\n"
    source = nbformat.read(chapters[0], as_version=4)
    source.cells[1].source = "print('changed')"  # the chapter was edited after that run
    nbformat.write(source, chapters[0])
    assert build.already_executed(chapters, done, root) == ({}, chapters)


def test_kernels_get_the_thread_policy_shared_out_between_jobs(tmp_path):
    """qlab/_tensor.py's policy: each of --jobs kernels gets its share of the threads, and
    OpenMP threads that wait passively."""
    from qlab._tensor import thread_count, thread_env

    _stage_fake_repo(
        tmp_path, ["import os; print(os.environ['OMP_NUM_THREADS'], os.environ['OMP_WAIT_POLICY'])"]
    )
    ran = build.execute_all(build.numbered(tmp_path / "notebooks"), 2, tmp_path)
    policy = thread_env(max(1, thread_count() // 2))
    printed = ran["notebooks/98_fine.ipynb"].cells[1].outputs[0]["text"]
    assert printed == f"{policy['OMP_NUM_THREADS']} {policy['OMP_WAIT_POLICY']}\n"


def test_stage_mirrors_the_repository(tmp_path):
    root = tmp_path / "repo"
    _stage_fake_repo(root, ["print('hi')"])
    executed = build.execute_all(build.numbered(root / "notebooks"), 1, root)
    assert executed["notebooks/98_fine.ipynb"].cells[1].outputs[0]["text"] == "hi\n"
    repo = build.Repo(root, None)
    pages = build.stage(repo, tmp_path / "src", executed)
    assert pages == [
        "README.md",
        "docs/GLOSSARY.md",
        "exercises/98_fine.ipynb",
        "notebooks/98_fine.ipynb",
    ]  # no solutions without the flag
    src = tmp_path / "src"
    chapter = nbformat.read(src / "notebooks" / "98_fine.ipynb", as_version=4)
    assert chapter.cells[0].source == "# 98 · A chapter"
    assert "read-only copy" in chapter.cells[1].source  # the banner right under the title
    assert chapter.cells[2].source == "Intro of 98."  # the rest of the title's cell
    assert chapter.cells[3].outputs  # executed
    exercise = nbformat.read(src / "exercises" / "98_fine.ipynb", as_version=4)
    assert not exercise.cells[2].outputs  # a statement: as committed, not executed
    assert "(../index.md)" in (src / "docs" / "GLOSSARY.md").read_text()
    home = (src / "index.md").read_text()
    assert "[98 A chapter](notebooks/98_fine.ipynb)" in home and "end" not in home
    with_solutions = build.stage(repo, tmp_path / "src2", executed, solutions=True)
    assert "solutions/98_fine.ipynb" in with_solutions


# ---------------------------------------------------------------- widgets on a static page


def test_static_picture_of_the_granularity_explorer():
    from qlab.widgets import GranularityExplorer

    explorer = GranularityExplorer()
    before = (explorer.family.value, explorer.granularity.value, explorer.readout.value)
    html = static_widgets.static_html(explorer)
    states = re.findall(r'<figure class="qlab-static-state">.*?</figure>', html, re.S)
    assert len(states) == 1 + len(static_widgets.STATES["GranularityExplorer"])
    images = [re.search(r'src="data:image/png;base64,([^"]+)"', s).group(1) for s in states]
    assert len(set(images)) == len(images)  # each state is its own picture
    assert "per tensor" in states[1] and "nvfp4" in states[2].lower()
    assert "JupyterLab" in html and "make lab" in html  # the note on the live version
    # the widget is left as it was
    assert (explorer.family.value, explorer.granularity.value, explorer.readout.value) == before


@pytest.mark.parametrize("name", ["DecodeCalculator", "FormatExplorer", "KVCacheExplorer"])
def test_static_picture_of_every_course_widget(name):
    import qlab.widgets

    widget = getattr(qlab.widgets, name)()
    html = static_widgets.static_html(widget)
    states = re.findall(r'<figure class="qlab-static-state">.*?</figure>', html, re.S)
    assert len(states) == 3
    readouts = [
        re.search(r'class="qlab-static-readout">(.*?)</div>', s, re.S).group(1) for s in states
    ]
    assert len(set(readouts)) == 3  # three different states, not one picture three times


def test_the_widget_mime_bundle_gains_the_picture():
    """The mechanism: IPython merges the registered text/html with the widget's own bundle."""
    from IPython.core.formatters import DisplayFormatter

    from qlab.widgets import FormatExplorer

    class Shell:  # what load_ipython_extension touches of the real InteractiveShell
        display_formatter = DisplayFormatter()

    static_widgets.load_ipython_extension(Shell)
    data, _ = Shell.display_formatter.format(FormatExplorer())
    assert "application/vnd.jupyter.widget-view+json" in data  # live in JupyterLab
    assert 'class="qlab-static-widget"' in data["text/html"]  # static on the site


def test_the_publishing_workflow_builds_with_make_site_and_deploys_site():
    """.github/workflows/site.yml cannot run here: check it is what docs/SITE.md says."""
    import yaml

    wf = yaml.safe_load((REPO / ".github" / "workflows" / "site.yml").read_text())
    triggers = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert triggers["push"]["branches"] == ["main"] and "workflow_dispatch" in triggers
    assert wf["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    steps = wf["jobs"]["build"]["steps"]
    runs = [s for s in steps if "run" in s]
    assert len(runs) == 1 and runs[0]["run"].startswith("make site")  # the README's command
    assert "github.repository" in runs[0]["env"]["QLAB_REPO_URL"]
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-pages"))
    assert upload["with"]["path"] == "site"
    deploy = wf["jobs"]["deploy"]
    assert deploy["needs"] == "build"
    assert deploy["steps"][0]["uses"].startswith("actions/deploy-pages@")
