"""Matplotlib without a front-end extension: draw on an Agg canvas, ship a PNG.

The widgets draw into a ``matplotlib.figure.Figure`` that is never registered with
pyplot (so no inline backend, no ipympl, no figure leaks) and put the PNG bytes in
an ``ipywidgets.Image``. That works in plain JupyterLab with only ipywidgets
installed, and headless (nbval, tests) where nothing renders at all.

Speed (each widget update must stay under 100 ms on a busy 2-core laptop): a full
Agg redraw of a two-panel figure costs 50-80 ms, mostly text (ticks, legends). So
a widget whose axes limits never change uses ``Blitter``: the static parts (axes,
ticks, labels, legends) are rendered once into a background, and an update only
restores it and draws the few artists that changed, then encodes the pixels.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

__all__ = ["Blitter", "figure_png", "new_figure"]

DPI = 72  # small enough to keep one redraw well under the 100 ms budget
PNG_COMPRESS_LEVEL = 1  # zlib level 1: 3-4x faster than the default, files ~30 % larger


def new_figure(width_in: float, height_in: float, ncols: int = 1):
    """A pyplot-free Figure with `ncols` axes side by side; returns (fig, axes).

    No layout engine: constrained layout alone costs ~150 ms per redraw, so the
    widgets place their axes once with ``fig.subplots_adjust``.
    """
    fig = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def _encode_canvas(canvas: FigureCanvasAgg) -> bytes:
    """PNG bytes of what the Agg canvas holds now (no redraw)."""
    w, h = canvas.get_width_height(physical=True)
    img = Image.frombuffer("RGBA", (w, h), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def figure_png(fig: Figure) -> bytes:
    """The whole figure redrawn and rendered as PNG bytes (what an ipywidgets.Image shows)."""
    fig.canvas.draw()
    return _encode_canvas(fig.canvas)


class Blitter:
    """Redraw only the artists that change; everything else comes from a cached background.

    ``dynamic`` artists are marked animated, so the full draw that makes the background
    leaves them out. The axes limits must not change after the first ``png()`` (they
    are part of the background); call ``invalidate()`` if they do.
    """

    def __init__(self, fig: Figure, dynamic: list):
        self.fig = fig
        self.dynamic = list(dynamic)
        for artist in self.dynamic:
            artist.set_animated(True)
        self._background = None

    def invalidate(self) -> None:
        self._background = None

    def png(self) -> bytes:
        canvas = self.fig.canvas
        if self._background is None:
            canvas.draw()  # everything but the animated artists
            self._background = canvas.copy_from_bbox(self.fig.bbox)
        else:
            canvas.restore_region(self._background)
        for artist in self.dynamic:
            self.fig.draw_artist(artist)
        return _encode_canvas(canvas)
