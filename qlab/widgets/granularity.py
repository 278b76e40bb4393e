"""The error-versus-granularity explorer: the course's main exploration widget.

Pick a scheme, a bit width, a granularity and how strong the outliers in the
weights are. The left plot is the weight histogram with the quantization grid of
a typical group drawn over it; the right plot is the error (RMSE) against
bits/element (metadata included) for every scheme, the current one highlighted;
a readout prints the numbers.

Logic (plain data, testable without a browser) comes first: ``make_weights``,
``scheme_for``, ``measure``, ``group_grid``, ``explorer_data``. The widget class
at the bottom only calls them and draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as W
import numpy as np
import torch

import qlab
from qlab import metrics
from qlab._tensor import torch_threads

from ._render import Blitter, new_figure

__all__ = [
    "FAMILIES",
    "GRANULARITIES",
    "INT_BITS",
    "GranularityExplorer",
    "Measurement",
    "explorer_data",
    "format_label",
    "group_grid",
    "make_weights",
    "measure",
    "scheme_for",
]

# label shown in the dropdown -> scheme family key
FAMILIES: dict[str, str] = {
    "INT (symmetric)": "int",
    "INT (asymmetric)": "int_asym",
    "NF4": "nf4",
    "FP8 E4M3": "fp8_e4m3",
    "FP8 E5M2": "fp8_e5m2",
    "MXFP8 (E4M3, block 32)": "mxfp8_e4m3",
    "MXFP6 (E2M3, block 32)": "mxfp6_e2m3",
    "MXFP4 (block 32)": "mxfp4",
    "NVFP4 (block 16)": "nvfp4",
}
INT_FAMILIES = ("int", "int_asym")
FIXED_BLOCK = {"mxfp8_e4m3": 32, "mxfp6_e2m3": 32, "mxfp4": 32, "nvfp4": 16}  # set by the format
# The diamonds of the error plot: each non-integer format at the granularity it is used with
# (notebooks 03-05), whatever the slider says, so NF4 is always NF4 with blocks of 64.
FORMAT_GRANULARITY: dict[str, str | int] = {
    "nf4": 64,
    "fp8_e4m3": "channel",
    "fp8_e5m2": "channel",
    **{f: "tensor" for f in FIXED_BLOCK},  # ignored: the format fixes its block
}
INT_BITS = tuple(range(2, 9))
GRANULARITIES: tuple[str | int, ...] = ("tensor", "channel", 256, 128, 64, 32, 16)

DEFAULT_SHAPE = (64, 512)  # (rows = output channels, cols = reduction axis K)
WEIGHT_STD = 0.02  # the usual init std (initializer_range of BERT, GPT-2, Llama configs)
OUTLIER_EVERY = 4096  # one outlier per this many weights (8 in the default 32768)
BULK_STD = 5.0  # the histogram shows +-5 std: the bulk, where the grid's resolution matters
# fixed y range of the error plot (fixed axes let the widget redraw only what moves):
# every setting of the explorer lands in [8.2e-5, 2.3e-2] on the default data
RMSE_RANGE = (5e-5, 5e-2)


# ---------------------------------------------------------------- logic (plain data)


def make_weights(
    outlier_strength: float = 0.0,
    shape: tuple[int, int] = DEFAULT_SHAPE,
    seed: int = 0,
) -> torch.Tensor:
    """Synthetic weights: N(0, 0.02^2) plus a few outliers of ``outlier_strength`` std.

    float32, ``shape`` (rows, K). One weight in 4096 (at seeded random positions) is
    replaced by +-outlier_strength * 0.02 (its magnitude kept where larger);
    strength 0 leaves a plain Gaussian, and a strength under the Gaussian's own largest
    |w| (4.3 std for the default shape and seed; notebook 04) only raises those weights,
    adding no outlier.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * WEIGHT_STD
    n_out = max(1, w.numel() // OUTLIER_EVERY)
    idx = torch.randperm(w.numel(), generator=gen)[:n_out]
    sign = torch.where(torch.rand(n_out, generator=gen) < 0.5, -1.0, 1.0)
    if outlier_strength > 0:
        flat = w.view(-1)
        flat[idx] = torch.maximum(flat[idx].abs(), torch.tensor(outlier_strength * WEIGHT_STD))
        flat[idx] *= sign
    return w


def scheme_for(family: str, bits: int = 4) -> qlab.Scheme:
    """The qlab Scheme of a family; ``bits`` only matters for the integer families."""
    if family == "int":
        return qlab.int_scheme(bits, symmetric=True)
    if family == "int_asym":
        return qlab.int_scheme(bits, symmetric=False)
    return qlab.get_scheme(family)


def effective_granularity(family: str, granularity: str | int) -> str | int | None:
    """What is passed to qlab.quantize: MX and NVFP4 fix their own block (None)."""
    return None if family in FIXED_BLOCK else granularity


def granularity_label(family: str, granularity: str | int) -> str:
    if family in FIXED_BLOCK:
        return f"block {FIXED_BLOCK[family]} (fixed by the format)"
    if granularity in ("tensor", "channel"):
        return f"per {granularity}"
    return f"group {granularity}"


@dataclass(frozen=True)
class Measurement:
    """One scheme at one granularity on one weight tensor."""

    scheme: str  # qlab scheme name, e.g. "int4"
    family: str  # key of FAMILIES, e.g. "int"
    bits: int  # element bits
    granularity: str | int | None  # as passed to qlab.quantize
    bits_per_element: float  # element bits + scale/zero-point bits per element
    rmse: float
    sqnr_db: float


def measure(w: torch.Tensor, family: str, bits: int, granularity: str | int) -> Measurement:
    """Quantize ``w`` with qlab and measure the error against the original."""
    return _measure_qt(w, family, bits, granularity)[0]


def _measure_qt(w, family, bits, granularity) -> tuple[Measurement, qlab.QTensor]:
    scheme = scheme_for(family, bits)
    gran = effective_granularity(family, granularity)
    qt = qlab.quantize(w, scheme, gran)
    w_hat = qt.dequantize()
    m = Measurement(
        scheme=scheme.name,
        family=family,
        bits=int(qlab.formats.get(scheme.element).bits),
        granularity=gran,
        bits_per_element=float(qt.bits_per_element),
        rmse=float(metrics.rmse(w, w_hat)),
        sqnr_db=float(metrics.sqnr_db(w, w_hat)),
    )
    return m, qt


def group_grid(qt: qlab.QTensor, group: int | None = None) -> tuple[torch.Tensor, int]:
    """The real values one group of ``qt`` can take: its dequantization grid.

    ``group`` is a flat index into ``qt.scales``; None picks a typical group, the one
    with the median scale. Returns (ascending float32 levels, the group index).
    Each level is scale * (element value - zero point) (times NVFP4's tensor scale).
    """
    scales = qt.scales.float().reshape(-1)
    if group is None:
        group = int(scales.argsort()[(scales.numel() - 1) // 2])
    values = qlab.formats.get(qt.scheme.element).values.float()
    zp = 0.0 if qt.zero_points is None else float(qt.zero_points.reshape(-1)[group])
    ts = 1.0 if getattr(qt, "tensor_scale", None) is None else float(qt.tensor_scale)
    levels = (values - zp) * float(scales[group]) * ts
    return levels.sort().values, group


class _Cache:
    """Measurements (and their QTensors) keyed by (outliers, seed, scheme, granularity).

    Moving the bits slider then only redraws; a new granularity or outlier strength
    recomputes the ~25 quantizations of the error plot once.
    """

    def __init__(self, max_items: int = 512):
        self.items: dict[tuple, tuple[Measurement, qlab.QTensor]] = {}
        self.weights: dict[tuple, torch.Tensor] = {}
        self.max_items = max_items

    def get_weights(self, outlier_strength: float, seed: int) -> torch.Tensor:
        key = (round(float(outlier_strength), 6), seed)
        if key not in self.weights:
            if len(self.weights) > 16:
                self.weights.clear()
            self.weights[key] = make_weights(outlier_strength, seed=seed)
        return self.weights[key]

    def get(self, outlier_strength, seed, family, bits, granularity):
        key = (
            round(float(outlier_strength), 6),
            seed,
            family,
            bits if family in INT_FAMILIES else None,
            effective_granularity(family, granularity),
        )
        if key not in self.items:
            if len(self.items) >= self.max_items:
                self.items.clear()
            w = self.get_weights(outlier_strength, seed)
            self.items[key] = _measure_qt(w, family, bits, granularity)
        return self.items[key]

    def measure(self, outlier_strength, seed, family, bits, granularity) -> Measurement:
        return self.get(outlier_strength, seed, family, bits, granularity)[0]


_DEFAULT_CACHE = _Cache()


def explorer_data(
    family: str = "int",
    bits: int = 4,
    granularity: str | int = 128,
    outlier_strength: float = 20.0,
    seed: int = 0,
    cache: _Cache | None = None,
    n_bins: int = 101,
) -> dict:
    """Everything the explorer shows, as plain data.

    Returns a dict with
      current      Measurement of the chosen setting
      histogram    (counts, bin_edges) numpy arrays of the weights within the bulk
                   (+-5 std); n_beyond weights lie outside it, out to +-weights_absmax
      grid         numpy levels of a typical group's grid, grid_group its index;
                   levels_in_bulk how many of them fall inside the histogram's range
      int_curves   {"int": [...], "int_asym": [...]} Measurements over INT_BITS
      gran_curve   the chosen scheme over GRANULARITIES (one point for MX/NVFP4)
      formats      Measurement of every non-integer family at its own usual granularity
                   (FORMAT_GRANULARITY: NF4 block 64, FP8 per channel, MX/NVFP4 their
                   block), independent of the granularity slider
      readout      the text of the numeric readout
    """
    # Long but flat (no branches beyond one): each block computes one field of the result.
    cache = cache or _DEFAULT_CACHE
    w = cache.get_weights(outlier_strength, seed)
    m, qt = cache.get(outlier_strength, seed, family, bits, granularity)
    levels, grid_group = group_grid(qt)

    amax = float(w.abs().max())
    bulk = BULK_STD * WEIGHT_STD
    counts, edges = np.histogram(w.numpy().ravel(), bins=n_bins, range=(-bulk, bulk))
    n_beyond = int((w.abs() > bulk).sum())
    grid = levels.numpy()
    levels_in_bulk = int(((grid >= -bulk) & (grid <= bulk)).sum())

    int_curves = {
        f: [cache.measure(outlier_strength, seed, f, b, granularity) for b in INT_BITS]
        for f in INT_FAMILIES
    }
    if family in FIXED_BLOCK:
        gran_curve = [m]
    else:
        gran_curve = [cache.measure(outlier_strength, seed, family, bits, g) for g in GRANULARITIES]
    others = [
        cache.measure(outlier_strength, seed, f, 8, FORMAT_GRANULARITY[f])
        for f in FAMILIES.values()
        if f not in INT_FAMILIES
    ]
    readout = (
        f"{m.scheme}, {granularity_label(family, granularity)}: "
        f"RMSE = {m.rmse:.3e} · SQNR = {m.sqnr_db:.1f} dB · "
        f"{m.bits_per_element:.3f} bits/element"
    )
    return {
        "current": m,
        "weights_absmax": amax,
        "histogram": (counts, edges),
        "n_beyond": n_beyond,
        "grid": grid,
        "levels_in_bulk": levels_in_bulk,
        "grid_group": grid_group,
        "int_curves": int_curves,
        "gran_curve": gran_curve,
        "formats": others,
        "readout": readout,
    }


# ---------------------------------------------------------------- display

_FAMILY_COLOURS = {
    "int": "tab:blue",
    "int_asym": "tab:cyan",
    "nf4": "tab:green",
    "fp8_e4m3": "tab:purple",
    "fp8_e5m2": "tab:pink",
    "mxfp8_e4m3": "tab:brown",
    "mxfp6_e2m3": "tab:olive",
    "mxfp4": "tab:orange",
    "nvfp4": "tab:gray",
}


def format_label(family: str) -> str:
    """Legend text of a format's diamond: its name and the granularity it is drawn at."""
    name = next(label for label, f in FAMILIES.items() if f == family)
    if family in FIXED_BLOCK:
        return name  # the dropdown label already says "block 32" / "block 16"
    g = FORMAT_GRANULARITY[family]
    return f"{name}, " + (f"block {g}" if isinstance(g, int) else f"per {g}")


def _gran_option(g: str | int) -> tuple[str, str | int]:
    return (g if isinstance(g, str) else f"g{g}", g)


class GranularityExplorer(W.VBox):
    """Error versus granularity: sliders -> histogram + grid, error curves, readout.

    Attributes a test (or a curious learner) can drive: ``family`` (Dropdown),
    ``bits`` (IntSlider), ``granularity`` (SelectionSlider), ``outliers``
    (FloatSlider); results in ``readout`` (HTML) and ``data`` (explorer_data's dict).
    """

    def __init__(
        self,
        family: str = "int",
        bits: int = 4,
        granularity: str | int = 128,
        outlier_strength: float = 20.0,
        seed: int = 0,
    ):
        # Long but declarative: one statement per control, then the layout and the wiring.
        self.seed = seed
        self._cache = _Cache()
        style = {"description_width": "110px"}
        wide = W.Layout(width="420px")
        self.family = W.Dropdown(
            options=list(FAMILIES.items()),
            value=family,
            description="scheme",
            style=style,
            layout=wide,
        )
        self.bits = W.IntSlider(
            value=bits,
            min=INT_BITS[0],
            max=INT_BITS[-1],
            description="bits (INT)",
            style=style,
            layout=wide,
            continuous_update=False,
        )
        self.granularity = W.SelectionSlider(
            options=[_gran_option(g) for g in GRANULARITIES],
            value=granularity,
            description="granularity",
            style=style,
            layout=wide,
            continuous_update=False,
        )
        self.outliers = W.FloatSlider(
            value=outlier_strength,
            min=0.0,
            max=100.0,
            step=5.0,
            description="outliers (x std)",
            style=style,
            layout=wide,
            continuous_update=False,
            readout_format=".0f",
        )
        self.readout = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width="900px"))
        for widget, cls in (
            (self.family, "qlab-family"),
            (self.bits, "qlab-bits"),
            (self.granularity, "qlab-granularity"),
            (self.outliers, "qlab-outliers"),
            (self.readout, "qlab-readout"),
            (self.image, "qlab-plot"),
        ):
            widget.add_class(cls)
        self.data: dict = {}
        self._build_plot()

        controls = W.HBox(
            [W.VBox([self.family, self.bits]), W.VBox([self.granularity, self.outliers])]
        )
        super().__init__([controls, self.readout, self.image])
        self.add_class("qlab-granularity-explorer")
        for c in (self.family, self.bits, self.granularity, self.outliers):
            c.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, _change=None) -> None:
        self.update()

    def update(self) -> dict:
        """Recompute from the controls' values, redraw; returns the new data."""
        family = self.family.value
        self.bits.disabled = family not in INT_FAMILIES
        self.granularity.disabled = family in FIXED_BLOCK
        with torch_threads(1):  # 32k elements: one thread is faster
            self.data = explorer_data(
                family,
                self.bits.value,
                self.granularity.value,
                self.outliers.value,
                seed=self.seed,
                cache=self._cache,
            )
        self.readout.value = f"<b>{self.data['readout']}</b>"
        self._draw()
        return self.data

    def _build_plot(self) -> None:
        """Create every artist once; _draw only updates their data (fast)."""
        self._fig, (ax_h, ax_e) = new_figure(12.0, 4.2, ncols=2)
        self._fig.subplots_adjust(left=0.06, right=0.99, bottom=0.13, top=0.92, wspace=0.16)
        self._ax_hist, self._ax_err = ax_h, ax_e
        self._hist = ax_h.stairs([1.0], [0.0, 1.0], fill=True, color="0.75", label="weights")
        self._grid_lines = ax_h.vlines(
            [], 0, 1, colors="tab:red", lw=0.8, alpha=0.8, label="grid of a typical group"
        )
        ax_h.set_xlabel("weight value (the bulk: ±5 std)")
        ax_h.set_ylabel("count")
        self._beyond_text = ax_h.text(
            0.01, 0.97, "", transform=ax_h.transAxes, fontsize=8, va="top", ha="left"
        )
        hist_legend = ax_h.legend(loc="upper right", fontsize=8)
        self._hist_limits = None  # (lo, hi, top) once data is drawn

        self._int_lines = {}
        for f, style, label in (
            ("int", "-o", "INT sym 2..8 bit, this granularity"),
            ("int_asym", "--s", "INT asym 2..8 bit, this granularity"),
        ):
            (self._int_lines[f],) = ax_e.plot(
                [], [], style, color=_FAMILY_COLOURS[f], ms=3, lw=1, label=label
            )
        (self._gran_line,) = ax_e.plot(
            [], [], ":", color="k", lw=1, label="current scheme, tensor → g16"
        )
        self._format_points = {}
        for f in FAMILIES.values():
            if f not in INT_FAMILIES:
                (self._format_points[f],) = ax_e.plot(
                    [], [], "D", color=_FAMILY_COLOURS[f], ms=5, label=format_label(f)
                )
        (self._star,) = ax_e.plot(
            [], [], "*", color="tab:red", ms=16, mec="k", label="current", zorder=5
        )
        ax_e.set_yscale("log")
        ax_e.minorticks_off()
        ax_e.set_xlim(1.5, 9.0)
        ax_e.set_ylim(*RMSE_RANGE)
        ax_e.set_xlabel("bits per element (scales and zero points included)")
        ax_e.set_ylabel("RMSE")
        ax_e.grid(True, alpha=0.3)
        ax_e.legend(fontsize=7, ncol=2, loc="lower left")  # the curves run top-left to bottom-right
        # only these change from one update to the next; the rest is a cached background
        self._blitter = Blitter(
            self._fig,
            [
                self._hist,
                self._grid_lines,
                self._beyond_text,
                ax_h.title,
                hist_legend,
                *self._int_lines.values(),
                self._gran_line,
                *self._format_points.values(),
                self._star,
            ],
        )

    def _draw(self) -> None:
        d = self.data
        m: Measurement = d["current"]
        counts, edges = d["histogram"]
        lo, hi = float(edges[0]), float(edges[-1])
        limits = self._hist_limits
        if limits is None or (lo, hi) != limits[:2] or counts.max() > limits[2] / 1.05:
            # new axes limits: the cached background is stale, redraw it once
            limits = self._hist_limits = (lo, hi, max(float(counts.max()), 1.0) * 1.15)
            self._ax_hist.set_xlim(lo, hi)
            self._ax_hist.set_ylim(0, limits[2])
            self._blitter.invalidate()
        top = limits[2]
        self._hist.set_data(counts, edges)
        grid = d["grid"]
        grid = grid[(grid >= lo) & (grid <= hi)]
        self._grid_lines.set_segments([[(g, 0), (g, top)] for g in grid])
        self._beyond_text.set_text(
            f"{d['n_beyond']} weights beyond the view,\nout to ±{d['weights_absmax']:.2f}"
            if d["n_beyond"]
            else "no weight beyond the view"
        )
        self._ax_hist.set_title(
            f"{m.scheme}, {granularity_label(m.family, self.granularity.value)}: "
            f"{d['levels_in_bulk']} grid levels in the bulk",
            fontsize=10,
        )

        for f, line in self._int_lines.items():
            pts = d["int_curves"][f]
            line.set_data([p.bits_per_element for p in pts], [p.rmse for p in pts])
        pts = d["gran_curve"] if len(d["gran_curve"]) > 1 else []
        self._gran_line.set_data([p.bits_per_element for p in pts], [p.rmse for p in pts])
        for p in d["formats"]:
            self._format_points[p.family].set_data([p.bits_per_element], [p.rmse])
        self._star.set_data([m.bits_per_element], [m.rmse])
        self.image.value = self._blitter.png()

    @property
    def rmse(self) -> float:
        return self.data["current"].rmse
