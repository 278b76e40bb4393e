"""Matplotlib without a front-end extension: draw on an Agg canvas, ship a PNG.

The widgets draw into a ``matplotlib.figure.Figure`` that is never registered with
pyplot (so no inline backend, no ipympl, no figure leaks) and put the PNG bytes in
an ``ipywidgets.Image``. That works in plain JupyterLab with only ipywidgets
installed, and headless (nbval, tests) where nothing renders at all.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["new_figure", "figure_png"]

DPI = 72  # small enough to keep one redraw well under the 100 ms budget


def new_figure(width_in: float, height_in: float, ncols: int = 1):
    """A pyplot-free Figure with `ncols` axes side by side; returns (fig, axes).

    No layout engine: constrained layout alone costs ~150 ms per redraw, so the
    widgets place their axes once with ``fig.subplots_adjust``.
    """
    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def figure_png(fig: Figure) -> bytes:
    """The figure rendered as PNG bytes (what an ipywidgets.Image displays)."""
    buf = io.BytesIO()
    fig.canvas.print_png(buf, pil_kwargs={"compress_level": 1})  # speed over size
    return buf.getvalue()
