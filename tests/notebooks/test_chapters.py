"""Every chapter runs top to bottom in a fresh kernel, so every figure it asserts holds.

The run is the site's (docs/site/build.py `execute`: nbclient, working directory
notebooks/, a 300 s cell timeout, the static-widget extension loaded), which checks what
`pytest --nbval-lax notebooks` checks: no cell raises. A failure names the chapter, the
cell and the error. Each executed chapter is kept for the site's browser test
(tests/site), so CI executes the chapters once, not twice.
"""

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("qlab_site_build", REPO / "docs/site/build.py")
site_build = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("qlab_site_build", site_build)
_spec.loader.exec_module(site_build)
CHAPTERS = site_build.numbered(REPO / "notebooks", None)


def test_every_chapter_is_collected():
    assert len(CHAPTERS) >= 16 and CHAPTERS[0].name == "00_why_quantization.ipynb"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_top_to_bottom(path, executed_chapters):
    try:
        nb = site_build.execute(path)
    except site_build.BuildError as e:
        pytest.fail(str(e), pytrace=False)
    nbformat.write(nb, executed_chapters / path.name)
