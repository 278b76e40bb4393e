"""Static pictures of the course's widgets, for the read-only website.

A live widget needs a kernel; a static page would show an empty box or a raw repr.
The site build loads this IPython extension into every kernel it executes a chapter
in (``--IPKernelApp.extensions=qlab_static_widgets``), so a widget displayed there
also carries a ``text/html`` snapshot in its mime bundle: the initial state and two
telling states, each as its settings, its readout and its plot (PNG), under a note
that the live version needs JupyterLab. JupyterLab itself never loads this module,
so a learner's notebook is unchanged and pays nothing.

How: IPython merges a widget's ``_repr_mimebundle_`` (``text/plain`` + the widget
view) with the per-type formatters registered here; the site's Sphinx config drops
the widget view, so MyST-NB renders the ``text/html``. A snapshot walks the widget
tree generically: ``Image`` -> ``<img>``, ``HTML``/``Label`` -> its markup, a control
with a description -> ``description: value``. ``STATES`` names, per widget class, the
attribute values of the telling states; each state is applied, captured, and the
initial values restored before the page moves on.
"""

from __future__ import annotations

import base64
import html

import ipywidgets as W

# class name -> [(caption, {attribute: value})]; attributes are the widgets' public
# controls (e.g. GranularityExplorer.granularity is its SelectionSlider)
STATES: dict[str, list[tuple[str, dict]]] = {
    "GranularityExplorer": [
        ("one scale for the whole tensor: the outliers set the step", {"granularity": "tensor"}),
        ("NVFP4: 4-bit floats with a scale per block of 16", {"family": "nvfp4"}),
    ],
    "FormatExplorer": [
        ("a value past E4M3's largest (448) saturates", {"value": 500.0}),
        (
            "the same value in E5M2: in range, on a coarser grid",
            {"format": "fp8_e5m2", "value": 500.0},
        ),
    ],
    "DecodeCalculator": [
        ("16-bit weights", {"weight_bits": 16}),
        ("the same 4-bit weights with an 8-bit KV cache", {"kv_bits": 8}),
    ],
    "KVCacheExplorer": [
        (
            "FP8 E4M3 with one calibrated scale per layer for K and one for V "
            "(the layout of vLLM's fp8 cache with per-tensor k_scale / v_scale)",
            {"scheme": "fp8_static_tensor"},
        ),
        # not a kivi scheme: those are decoded token by token, ~6 s more per site build
        (
            "2 bits per token (levels -1, 0, 1): the error is large from the first position "
            "and grows along the sequence",
            {"scheme": "int2"},
        ),
    ],
}
NOTE = (
    "Interactive widget, shown here as static pictures of {n} states. To move the "
    "controls yourself, open this notebook live: JupyterLab (<code>make lab</code>), "
    "Binder or Colab (links at the top of the page)."
)


def _controls(widget: W.Widget) -> list[W.ValueWidget]:
    """Every enabled control with a description under ``widget`` (depth first)."""
    found = []
    described = isinstance(widget, W.ValueWidget) and getattr(widget, "description", "")
    if described and not getattr(widget, "disabled", False):
        found.append(widget)
    for child in getattr(widget, "children", ()):
        found += _controls(child)
    return found


def _label(control: W.ValueWidget) -> str:
    """What the control shows as its value (the option's label for a selection)."""
    label = getattr(control, "label", None)  # Dropdown, SelectionSlider: the shown label
    return str(control.value if label is None else label)


def _outputs(widget: W.Widget) -> list[str]:
    """HTML for what the widget displays: its HTML/Label text and its images."""
    parts = []
    if isinstance(widget, W.Image) and widget.value:
        data = base64.b64encode(widget.value).decode("ascii")
        parts.append(
            f'<img class="qlab-static-plot" alt="plot of this state" '
            f'src="data:image/{widget.format};base64,{data}">'
        )
    elif isinstance(widget, (W.HTML, W.HTMLMath)) and widget.value:
        parts.append(f'<div class="qlab-static-readout">{widget.value}</div>')
    elif isinstance(widget, W.Label) and widget.value:
        parts.append(f'<div class="qlab-static-readout">{html.escape(widget.value)}</div>')
    for child in getattr(widget, "children", ()):
        parts += _outputs(child)
    return parts


def snapshot(widget: W.Widget, caption: str) -> str:
    """One state of ``widget`` as an HTML figure: caption, settings, readout, plots."""
    settings = ", ".join(
        f"{html.escape(c.description)} = <b>{html.escape(_label(c))}</b>" for c in _controls(widget)
    )
    return (
        '<figure class="qlab-static-state">'
        f"<figcaption>{html.escape(caption)}<br><small>{settings}</small></figcaption>"
        + "".join(_outputs(widget))
        + "</figure>"
    )


def static_html(widget: W.Widget) -> str:
    """The widget's initial state and its telling states (``STATES``), as one HTML block.

    The widget is left exactly as it was: every changed attribute is set back.
    """
    states = STATES.get(type(widget).__name__, [])
    figures = [snapshot(widget, "initial state")]
    for caption, values in states:
        before = {name: getattr(widget, name).value for name in values}
        try:
            for name, value in values.items():
                getattr(widget, name).value = value
            figures.append(snapshot(widget, caption))
        finally:
            for name, value in before.items():
                getattr(widget, name).value = value
    note = NOTE.format(n=len(figures))
    return (
        '<div class="qlab-static-widget">'
        f'<p class="qlab-static-note">{note}</p>' + "".join(figures) + "</div>"
    )


def load_ipython_extension(ipython) -> None:
    """Register ``static_html`` as the text/html formatter of every widget box."""
    formatter = ipython.display_formatter.formatters["text/html"]
    # a Box is what every course widget is (VBox); a lone slider gets no snapshot
    formatter.for_type(W.Box, static_html)
