"""Sphinx configuration of the course website (used by docs/site/build.py, not run alone).

The source tree is staged by build.py (executed chapters, exercise statements, docs
pages, index.md from the README); MyST-NB renders the notebooks as they are
(execution off: build.py already ran them with nbclient). Everything the pages load
is local (theme assets, search index, MathJax), so the site also works offline.
"""

import os
from pathlib import Path

import jupyter_server_mathjax

project = "qlab: a course on neural-network quantization"
author = "the qlab authors"
copyright = "the qlab authors, MIT licence"

extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = [
    "myst.header",  # a notebook may jump from # to ### (a style choice, not an error)
    "mystnb.unknown_mime_type",  # e.g. a widget's view when the static picture is shown
]

# --- MyST and MyST-NB
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve
nb_execution_mode = "off"  # build.py executed the chapters; exercises stay unexecuted
nb_merge_streams = True
# A widget's live view needs a kernel: drop it, so MyST-NB shows the text/html static
# picture that qlab_static_widgets added to the same output (and loads no widget JS).
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_ipywidgets_js = {}

# --- MathJax 2.7 shipped by the jupyter-server-mathjax package, copied into the site
MATHJAX_DIR = Path(jupyter_server_mathjax.__file__).parent / "static"
html_static_path = ["_static"]
html_extra_path = []
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"
myst_update_mathjax = False  # it writes a MathJax 3 config; the classes are set below
mathjax2_config = {
    "tex2jax": {
        "inlineMath": [["\\(", "\\)"]],
        "displayMath": [["\\[", "\\]"]],
        "processRefs": False,
        "processEnvironments": False,
        # Sphinx marks the page body tex2jax_ignore: typeset only the math it emits
        "processClass": "math|output_area",
        "ignoreClass": "tex2jax_ignore|mathjax_ignore|document",
    },
    "messageStyle": "none",
    # the package ships the STIX-Web fonts only (as Jupyter's classic notebook used them)
    "HTML-CSS": {
        "availableFonts": [],
        "webFont": "STIX-Web",
        "imageFont": None,
        # MathJax 2's zero-width test font is url('about:blank'), which Chromium refuses
        # with a console error (CORS); a local() source makes no request at all
        "styles": {"@font-face": {"font-family": "MathJax_Blank", "src": "local('MathJax_Blank')"}},
    },
    "SVG": {"font": "STIX-Web"},
}


def _copy_mathjax(app, exception):
    """After a successful HTML build, put MathJax under <out>/_static/mathjax."""
    if exception is None and app.builder.format == "html":
        import shutil

        shutil.copytree(MATHJAX_DIR, Path(app.outdir) / "_static" / "mathjax", dirs_exist_ok=True)


# --- theme: sphinx-book-theme (left navigation, prev/next, search, launch buttons)
html_theme = "sphinx_book_theme"
html_title = "qlab: quantization course"
html_css_files = ["qlab.css"]
html_favicon = "_static/favicon.svg"  # without one the browser logs a 404 for /favicon.ico
html_copy_source = True  # the theme's download button offers the .ipynb
html_show_sourcelink = False
REPO_URL = os.environ.get("QLAB_REPO_URL") or ""
html_context = {"default_mode": "light"}  # else the theme logs an error on a first visit
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "use_download_button": True,
    "navigation_with_keys": False,
}
if REPO_URL:
    html_theme_options |= {
        "repository_url": REPO_URL,
        "repository_branch": os.environ.get("QLAB_REPO_BRANCH", "main"),
        "path_to_docs": "",
        "use_repository_button": True,
        "launch_buttons": {
            "binderhub_url": "https://mybinder.org",
            "colab_url": "https://colab.research.google.com",
            "notebook_interface": "jupyterlab",
        },
    }


def setup(app):
    app.connect("build-finished", _copy_mathjax)
