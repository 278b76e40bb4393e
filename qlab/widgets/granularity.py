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

from ._render import figure_png, new_figure

__all__ = [
    "FAMILIES",
    "GRANULARITIES",
    "INT_BITS",
    "GranularityExplorer",
    "Measurement",
    "explorer_data",
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
INT_BITS = tuple(range(2, 9))
GRANULARITIES: tuple[str | int, ...] = ("tensor", "channel", 256, 128, 64, 32, 16)

DEFAULT_SHAPE = (64, 512)  # (rows = output channels, cols = reduction axis K)
WEIGHT_STD = 0.02  # typical std of a trained linear layer's weights
OUTLIER_EVERY = 4096  # one outlier per this many weights (8 in the default 32768)


# ---------------------------------------------------------------- logic (plain data)


def make_weights(
    outlier_strength: float = 0.0,
    shape: tuple[int, int] = DEFAULT_SHAPE,
    seed: int = 0,
) -> torch.Tensor:
    """Synthetic weights: N(0, 0.02^2) plus a few outliers of ``outlier_strength`` std.

    float32, ``shape`` (rows, K). One weight in 4096 (at seeded random positions) is
    replaced by +-outlier_strength * 0.02; strength 0 (or anything under the ~4.5
    std a Gaussian reaches anyway) leaves a plain Gaussian.
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
    scheme = scheme_for(family, bits)
    gran = effective_granularity(family, granularity)
    qt = qlab.quantize(w, scheme, gran)
    w_hat = qt.dequantize()
    return Measurement(
        scheme=scheme.name,
        family=family,
        bits=int(qlab.formats.get(scheme.element).bits),
        granularity=gran,
        bits_per_element=float(qt.bits_per_element),
        rmse=float(metrics.rmse(w, w_hat)),
        sqnr_db=float(metrics.sqnr_db(w, w_hat)),
    )


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
    """Measurements keyed by (outlier strength, seed, scheme, granularity)."""

    def __init__(self, max_items: int = 4096):
        self.items: dict[tuple, Measurement] = {}
        self.weights: dict[tuple, torch.Tensor] = {}
        self.max_items = max_items

    def get_weights(self, outlier_strength: float, seed: int) -> torch.Tensor:
        key = (round(float(outlier_strength), 6), seed)
        if key not in self.weights:
            if len(self.weights) > 16:
                self.weights.clear()
            self.weights[key] = make_weights(outlier_strength, seed=seed)
        return self.weights[key]

    def measure(self, outlier_strength, seed, family, bits, granularity) -> Measurement:
        key = (round(float(outlier_strength), 6), seed, family,
               bits if family in INT_FAMILIES else None,
               effective_granularity(family, granularity))
        if key not in self.items:
            if len(self.items) >= self.max_items:
                self.items.clear()
            w = self.get_weights(outlier_strength, seed)
            self.items[key] = measure(w, family, bits, granularity)
        return self.items[key]


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
      histogram    (counts, bin_edges) numpy arrays of the weights
      grid         numpy levels of a typical group's grid, grid_group its index
      int_curves   {"int": [...], "int_asym": [...]} Measurements over INT_BITS
      gran_curve   the chosen scheme over GRANULARITIES (one point for MX/NVFP4)
      formats      Measurement of every non-integer family at this granularity
      readout      the text of the numeric readout
    """
    cache = cache or _DEFAULT_CACHE
    w = cache.get_weights(outlier_strength, seed)
    m = cache.measure(outlier_strength, seed, family, bits, granularity)

    scheme = scheme_for(family, bits)
    qt = qlab.quantize(w, scheme, effective_granularity(family, granularity))
    levels, grid_group = group_grid(qt)

    amax = float(w.abs().max())
    counts, edges = np.histogram(w.numpy().ravel(), bins=n_bins, range=(-amax, amax))

    int_curves = {
        f: [cache.measure(outlier_strength, seed, f, b, granularity) for b in INT_BITS]
        for f in INT_FAMILIES
    }
    if family in FIXED_BLOCK:
        gran_curve = [m]
    else:
        gran_curve = [
            cache.measure(outlier_strength, seed, family, bits, g) for g in GRANULARITIES
        ]
    others = [
        cache.measure(outlier_strength, seed, f, 8, granularity)
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
        "grid": levels.numpy(),
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
        self.seed = seed
        self._cache = _Cache()
        style = {"description_width": "110px"}
        wide = W.Layout(width="420px")
        self.family = W.Dropdown(
            options=list(FAMILIES.items()), value=family, description="scheme",
            style=style, layout=wide,
        )
        self.bits = W.IntSlider(
            value=bits, min=INT_BITS[0], max=INT_BITS[-1], description="bits (INT)",
            style=style, layout=wide, continuous_update=False,
        )
        self.granularity = W.SelectionSlider(
            options=[_gran_option(g) for g in GRANULARITIES], value=granularity,
            description="granularity", style=style, layout=wide, continuous_update=False,
        )
        self.outliers = W.FloatSlider(
            value=outlier_strength, min=0.0, max=100.0, step=5.0,
            description="outliers (x std)", style=style, layout=wide,
            continuous_update=False, readout_format=".0f",
        )
        self.readout = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width="900px"))
        for widget, cls in (
            (self.family, "qlab-family"), (self.bits, "qlab-bits"),
            (self.granularity, "qlab-granularity"), (self.outliers, "qlab-outliers"),
            (self.readout, "qlab-readout"), (self.image, "qlab-plot"),
        ):
            widget.add_class(cls)
        self.data: dict = {}
        self._fig, (self._ax_hist, self._ax_err) = new_figure(12.0, 4.2, ncols=2)

        controls = W.HBox([W.VBox([self.family, self.bits]),
                           W.VBox([self.granularity, self.outliers])])
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
        self.data = explorer_data(
            family, self.bits.value, self.granularity.value, self.outliers.value,
            seed=self.seed, cache=self._cache,
        )
        self.readout.value = f"<b>{self.data['readout']}</b>"
        self._draw()
        return self.data

    def _draw(self) -> None:
        d = self.data
        m: Measurement = d["current"]
        ax = self._ax_hist
        ax.clear()
        counts, edges = d["histogram"]
        ax.stairs(counts, edges, fill=True, color="0.75", label="weights")
        lo, hi = edges[0], edges[-1]
        grid = d["grid"]
        grid = grid[(grid >= lo) & (grid <= hi)]
        ax.vlines(grid, 0.8, max(counts.max(), 1) * 1.5, colors="tab:red", lw=0.8, alpha=0.8,
                  label=f"grid of a typical group ({len(grid)} levels in view)")
        ax.set_yscale("log")
        ax.set_ylim(0.8, max(counts.max(), 1) * 1.5)
        ax.set_xlim(lo, hi)
        ax.set_xlabel("weight value")
        ax.set_ylabel("count (log)")
        ax.set_title(f"{m.scheme}, {granularity_label(m.family, self.granularity.value)}")
        ax.legend(loc="upper right", fontsize=8)

        ax = self._ax_err
        ax.clear()
        for f, style in (("int", "-o"), ("int_asym", "--s")):
            pts = d["int_curves"][f]
            ax.plot([p.bits_per_element for p in pts], [p.rmse for p in pts], style,
                    color=_FAMILY_COLOURS[f], ms=3, lw=1,
                    label=f"{'INT sym' if f == 'int' else 'INT asym'} 2..8 bit")
        if len(d["gran_curve"]) > 1:
            pts = d["gran_curve"]
            ax.plot([p.bits_per_element for p in pts], [p.rmse for p in pts], ":",
                    color="k", lw=1, label=f"{m.scheme}: tensor → g16")
        for p in d["formats"]:
            ax.plot(p.bits_per_element, p.rmse, "D", color=_FAMILY_COLOURS[p.family], ms=5,
                    label=p.scheme)
        ax.plot(m.bits_per_element, m.rmse, "*", color="tab:red", ms=16, mec="k",
                label="current", zorder=5)
        ax.set_yscale("log")
        ax.set_xlabel("bits per element (scales and zero points included)")
        ax.set_ylabel("RMSE")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper right")
        self.image.value = figure_png(self._fig)

    @property
    def rmse(self) -> float:
        return self.data["current"].rmse

