"""The format explorer: a value goes in, its code, fields and neighbours come out.

Pick an element format (FP8, FP6, FP4, E8M0, NF4, INT) and type a real value: the
explorer encodes it with ``qlab.formats.get(name).encode`` (round-half-to-even,
saturating), shows the code in binary split into sign/exponent/mantissa, the value
the code decodes to, the rounding error, and the representable neighbours on
either side (the local step of the grid).

``describe_value`` is the logic (plain data); ``FormatExplorer`` displays it.
"""

from __future__ import annotations

import math

import ipywidgets as W
import numpy as np
import torch

from qlab import formats

from ._render import figure_png, new_figure

__all__ = ["EXPLORER_FORMATS", "FormatExplorer", "describe_value"]

EXPLORER_FORMATS = (
    "fp8_e4m3fn",
    "fp8_e5m2",
    "fp6_e2m3fn",
    "fp6_e3m2fn",
    "fp4_e2m1fn",
    "e8m0fnu",
    "nf4",
    "int8",
    "int4",
)
N_NEIGHBOURS = 3  # representable values drawn on each side


def describe_value(fmt_name: str, x: float, saturate: bool = True) -> dict:
    """Encode one real value in a format and describe the result.

    Returns a dict: format, input, code (int), bits (the code in binary, fields
    separated by dots for minifloats), fields (sign/exponent/mantissa... as
    qlab.formats gives them), value (what the code decodes to), below/above (the
    representable neighbours of that value, None at the ends), step (above - below
    around the value), abs_error, rel_error (None when undefined), window (a few
    representable values around it, ascending, for a number line).
    """
    fmt = formats.get(fmt_name)
    code = int(fmt.encode(torch.tensor([float(x)], dtype=torch.float32), saturate=saturate)[0])
    fields = fmt.fields(code)
    value = float(fields["value"])
    # + 0.0 turns a listed -0.0 into 0.0: as a grid point zero is unsigned ("0", not "-0");
    # the decoded value keeps its sign (code 0x80 of E4M3 really is -0)
    values = fmt.values.double().numpy() + 0.0
    if math.isfinite(value):
        i = int(np.searchsorted(values, value))  # values[i] == value (finite codes are listed)
        below = float(values[i - 1]) if i > 0 else None
        above = float(values[i + 1]) if i + 1 < len(values) else None
        lo, hi = max(0, i - N_NEIGHBOURS), min(len(values), i + N_NEIGHBOURS + 1)
        window = values[lo:hi].astype(np.float64)
        abs_error = abs(value - float(x)) if math.isfinite(x) else None
        rel_error = abs_error / abs(x) if abs_error is not None and x != 0 else None
    else:
        below = above = abs_error = rel_error = None
        window = np.zeros(0)
    step = (above - below) / 2 if below is not None and above is not None else None
    return {
        "format": fmt_name,
        "input": float(x),
        "code": code,
        "bits": fields["bits"],
        "fields": {k: v for k, v in fields.items() if k not in ("code", "bits", "value")},
        "value": value,
        "below": below,
        "above": above,
        "step": step,
        "abs_error": abs_error,
        "rel_error": rel_error,
        "window": window,
        "max": float(fmt.max),
    }


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.6g}"


def describe_html(d: dict) -> str:
    """The readout table of describe_value's dict."""
    f = d["fields"]
    field_rows = "".join(f"<tr><td>{k}</td><td><code>{v}</code></td></tr>" for k, v in f.items())
    rel = "—" if d["rel_error"] is None else f"{100 * d['rel_error']:.3g} %"
    code_hex = d["code"] & 0xFF
    return (
        f"<table class='qlab-format-table'>"
        f"<tr><td>input</td><td><code>{d['input']:.6g}</code></td></tr>"
        f"<tr><td>code</td><td><code>{d['bits']}</code> (= {d['code']}, 0x{code_hex:02x})</td></tr>"
        f"{field_rows}"
        f"<tr><td>decodes to</td><td><b><code>{_fmt(d['value'])}</code></b></td></tr>"
        f"<tr><td>error</td><td><code>{_fmt(d['abs_error'])}</code> ({rel})</td></tr>"
        f"<tr><td>neighbours</td><td><code>{_fmt(d['below'])}</code> &lt; · &lt; "
        f"<code>{_fmt(d['above'])}</code></td></tr>"
        f"<tr><td>largest value</td><td><code>{d['max']:.6g}</code></td></tr>"
        f"</table>"
    )


class FormatExplorer(W.VBox):
    """Format dropdown + value box -> code, fields, decoded value, neighbours, number line."""

    def __init__(self, fmt: str = "fp8_e4m3fn", value: float = 0.3):
        style = {"description_width": "70px"}
        self.format = W.Dropdown(
            options=list(EXPLORER_FORMATS), value=fmt, description="format", style=style
        )
        self.value = W.FloatText(
            value=value, description="value", style=style, continuous_update=False
        )
        self.readout = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width="640px"))
        self.format.add_class("qlab-format")
        self.value.add_class("qlab-value")
        self.readout.add_class("qlab-readout")
        self.data: dict = {}
        self._build_plot()
        super().__init__([W.HBox([self.format, self.value]), self.readout, self.image])
        self.add_class("qlab-format-explorer")
        self.format.observe(self._on_change, names="value")
        self.value.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, _change=None) -> None:
        self.update()

    def update(self) -> dict:
        self.data = describe_value(self.format.value, self.value.value)
        self.readout.value = describe_html(self.data)
        self._draw()
        return self.data

    def _build_plot(self) -> None:
        self._fig, ax = new_figure(8.0, 1.7)
        self._fig.subplots_adjust(left=0.02, right=0.98, bottom=0.22, top=0.72)
        self._ax = ax
        self._ticks = ax.vlines([], -1, 1, colors="tab:blue", lw=1.5)
        (self._dot,) = ax.plot([], [], "o", color="tab:blue", ms=9, label="decoded")
        (self._input,) = ax.plot([], [], "--", color="tab:red", lw=1.5, label="input")
        self._labels = [
            ax.text(0, 1.1, "", ha="center", va="bottom", fontsize=8)
            for _ in range(2 * N_NEIGHBOURS + 1)
        ]
        self._note = ax.text(0.5, -0.35, "", transform=ax.transAxes, ha="center", fontsize=8)
        ax.set_ylim(-1.2, 1.8)
        ax.set_yticks([])
        ax.legend(loc="lower right", fontsize=7)

    def _draw(self) -> None:
        d, ax = self.data, self._ax
        win = [float(v) for v in d["window"]]
        x = d["input"]
        self._ticks.set_segments([[(v, -1), (v, 1)] for v in win])
        self._dot.set_data([d["value"]] if win else [], [0] if win else [])
        for label, v in zip(self._labels, win + [None] * len(self._labels), strict=False):
            label.set_text("" if v is None else f"{v:.4g}")
            if v is not None:
                label.set_x(v)
        span = list(win)
        note = ""
        if math.isfinite(x) and win:
            width = (win[-1] - win[0]) or 1.0
            if win[0] - width <= x <= win[-1] + width:
                span.append(x)
            else:
                note = f"input {x:.4g} is off this view: it saturates / rounds to {d['value']:.4g}"
        elif not math.isfinite(d["value"]):
            note = f"{x} has no finite code in {d['format']}: code {d['code']} (NaN)"
        self._note.set_text(note)
        if x in span:
            self._input.set_data([x, x], [-1.2, 1.8])
        else:
            self._input.set_data([], [])
        lo, hi = (min(span), max(span)) if span else (-1.0, 1.0)
        pad = 0.08 * (hi - lo) if hi > lo else max(abs(lo), 1.0) * 0.1
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_title(f"{d['format']}: representable values around {x:.4g}", fontsize=9)
        self.image.value = figure_png(self._fig)
