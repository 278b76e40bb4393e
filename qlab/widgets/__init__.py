"""Interactive widgets of the course (ipywidgets 8, no other front-end extension).

- DecodeCalculator: model/bits/group/device -> decode ceiling, KV memory, sequences.
- GranularityExplorer: scheme/bits/granularity/outliers -> histogram + grid, error plot.
- FormatExplorer: format + value -> code, sign/exponent/mantissa fields, neighbours.
- kv_explorer (KVCacheExplorer): KV-cache scheme -> attention and KL error along the sequence.
- check_prediction: the "predict, then check" cells of the notebooks (plain text, no widget).

Each module keeps its logic in plain functions returning plain data (decode_summary,
explorer_data, describe_value), testable without a browser; the widget classes only
display it. Plots are rendered with matplotlib's Agg backend into an
ipywidgets.Image, so they work in plain JupyterLab and headless (nbval, tests).
Display a widget by leaving it as the last expression of a cell.
"""

from qlab.widgets.decode import DecodeCalculator, decode_summary
from qlab.widgets.format_explorer import FormatExplorer, describe_value
from qlab.widgets.granularity import (
    GranularityExplorer,
    Measurement,
    explorer_data,
    group_grid,
    make_weights,
    measure,
)
from qlab.widgets.kv import KVCacheExplorer, kv_explorer
from qlab.widgets.predict import check_prediction

__all__ = [
    "DecodeCalculator",
    "check_prediction",
    "FormatExplorer",
    "GranularityExplorer",
    "KVCacheExplorer",
    "Measurement",
    "decode_summary",
    "describe_value",
    "explorer_data",
    "group_grid",
    "kv_explorer",
    "make_weights",
    "measure",
]
