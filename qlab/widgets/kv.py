"""The KV-cache explorer: pick how the cache is stored, see the error along the sequence.

Pick one of qlab.kv's schemes (``qlab.kv.KV_SCHEME_NAMES``). On TinyLM and a few
validation windows, the left plot is the relative error of each layer's attention output
at every query position (``qlab.kv.attention_errors``: that layer's cache alone, on the
float model's queries, keys and values, read as a server decoding one token at a time
reads it); the right plot is the KL divergence of the next-byte predictions at every
position (``qlab.lm.quality.kl_by_position``: the whole model, every layer's cache
stored as the scheme stores it, errors carried from layer to layer). The readout gives
the bits per cached element (scales included, ``qlab.kv.bits_per_element``), the means
and the top-1 flip rate.

Logits: a scheme with a full-precision window of recent tokens is decoded one token at a
time (``qlab.kv.decode_logits``: its cache depends on the sequence length); the others
take one full forward pass, which reads the values their cache would store (qlab.kv's
docstring; tests/test_widgets.py checks it against decoding). Each scheme is measured the
first time it is picked and kept: on the default 8 windows of 256 bytes that costs
0.5-0.9 s of CPU for a scheme without a window and 5.5-6.5 s for a kivi scheme (measured
on a busy 2-core machine, one thread); picking it again, 0.03 s.

``KVErrors`` holds the logic (plain data, testable without a browser);
``KVCacheExplorer`` displays it; ``kv_explorer()`` is what a notebook cell calls.
"""

from __future__ import annotations

import ipywidgets as W
import numpy as np
import torch

import qlab.metrics
from qlab import kv
from qlab.lm import quality
from qlab.lm.model import TinyLM

from ._render import Blitter, new_figure

__all__ = ["KVCacheExplorer", "KVErrors", "describe_scheme", "kv_explorer"]

N_WINDOWS = 8  # validation windows of block_size (256) bytes each
BLOCK = 16  # the bold KL curve: mean over blocks of 16 positions (KIVI's chunks are 32)
# fixed y ranges (fixed axes let an update redraw only the curves), their top decade left
# free for the legend; values below a floor are left off the plot and counted in its note.
# Measured on the default windows: the largest values are 1.5 (attention) and 2.0 (KL),
# both int2's; below the floors lie only "hadamard" (float32 rounding: attention <= 4e-6,
# KL <= 3e-11) and the first 32-36 positions of the kivi schemes (their float window)
ATTN_RANGE = (1e-4, 30.0)
KL_RANGE = (1e-6, 100.0)


def describe_scheme(scheme: str | kv.KVScheme) -> str:
    """One line on how ``scheme`` stores K and V, read off its qlab.kv.KVScheme fields."""
    s = kv.get_kv_scheme(scheme)
    parts = ["Hadamard on keys and queries"] if s.rotate else []
    if s.element is None:
        parts.append("nothing quantized")
    elif s.static is not None:
        parts.append(f"{s.element}, one calibrated scale per {s.static} (static)")
    else:
        per = "one scale per token and head" if s.group is None else f"groups of {s.group} channels"
        if s.key_axis == "channel":
            parts.append(f"{s.element}, keys per channel (chunks of {s.group} tokens), "
                         f"values per token ({per})")
        else:
            parts.append(f"{s.element}, keys and values per token ({per})")
    if s.window:
        parts.append(f"the {s.window} most recent tokens kept in float")
    return "; ".join(parts)


class KVErrors:
    """Each scheme's error along the sequence on one model and one set of windows,
    measured once (on the first ``get``) and kept.

    model: a TinyLM (default: the shipped checkpoint); windows: int64 (N, T + 1), T a
    multiple of 32 (default: ``N_WINDOWS`` validation windows of block_size bytes).
    """

    def __init__(self, model: TinyLM | None = None, windows: torch.Tensor | None = None):
        self.model = quality.load_model() if model is None else model
        if windows is None:
            windows = quality.validation_windows(N_WINDOWS, self.model.cfg.block_size)
        T = windows.shape[1] - 1
        if T % (2 * BLOCK):
            raise ValueError(
                f"windows of {T} positions (shape {tuple(windows.shape)}): the explorer needs "
                f"a multiple of {2 * BLOCK} (whole KIVI chunks and {BLOCK}-position blocks); "
                "use quality.validation_windows(n, 256)"
            )
        self.windows = windows
        self._ref: torch.Tensor | None = None
        self._data: dict[str, dict] = {}

    @property
    def ref_logits(self) -> torch.Tensor:
        """float32 (N, T, vocab): the float model's logits (one full forward, computed once)."""
        if self._ref is None:
            self._ref = quality.logits(self.model, self.windows)
        return self._ref

    def logits(self, scheme: str) -> tuple[torch.Tensor, bool]:
        """(logits of the model with its cache stored as ``scheme``, decoded token by token?)."""
        q_model = kv.quantize_cache(self.model, scheme)
        if kv.get_kv_scheme(scheme).window:
            return kv.decode_logits(q_model, self.windows), True
        return quality.logits(q_model, self.windows), False

    def get(self, scheme: str) -> dict:
        """Everything the explorer shows for ``scheme`` (a name of kv.KV_SCHEME_NAMES):

        scheme, description, bits_per_element (K and V, scales included, for one sequence
        of T tokens), decoded (bool: logits decoded token by token), kl (float64 (T,) mean
        KL per position over the windows, nats), kl_blocks (float64 (T // BLOCK,) its means
        over blocks of BLOCK positions), kl_mean, flip_rate, attn (float64 (n_layer, T)
        relative attention-output error), attn_mean, n_windows, seq_len.
        """
        name = kv.get_kv_scheme(scheme).name  # ValueError naming the known schemes
        if name not in self._data:
            self._data[name] = self._measure(name)
        return self._data[name]

    def measured(self, scheme: str) -> bool:
        """Whether ``scheme`` was measured already (picking it again costs nothing)."""
        return kv.get_kv_scheme(scheme).name in self._data

    def _measure(self, name: str) -> dict:
        q_logits, decoded = self.logits(name)
        kl = quality.kl_by_position(self.ref_logits, q_logits).double().numpy()
        attn = kv.attention_errors(self.model, name, self.windows)["outputs"].numpy()
        N, T = self.windows.shape[0], self.windows.shape[1] - 1
        return {
            "scheme": name,
            "description": describe_scheme(name),
            "bits_per_element": float(
                kv.bits_per_element(name, head_dim=self.model.cfg.head_dim, seq_len=T)
            ),
            "decoded": decoded,
            "kl": kl,
            "kl_blocks": kl.reshape(-1, BLOCK).mean(axis=1),
            "kl_mean": float(kl.mean()),
            "flip_rate": float(qlab.metrics.flip_rate(self.ref_logits, q_logits)),
            "attn": attn,
            "attn_mean": float(attn.mean()),
            "n_windows": N,
            "seq_len": T,
        }


def readout_html(d: dict) -> str:
    """The explorer's readout for a KVErrors.get dict."""
    how = ("decoded token by token, as a server reads a cache with a float window"
           if d["decoded"] else "one full forward pass")
    return (
        f"<b>{d['scheme']}</b>: {d['description']}<br>"
        f"<b>{d['bits_per_element']:.3f} bits per cached element</b> (K and V, scales "
        f"included, {d['seq_len']}-token sequence) · mean KL <b>{d['kl_mean']:.3e}</b> nats "
        f"per byte · top-1 flips {100 * d['flip_rate']:.2f} % · attention-output error "
        f"{d['attn_mean']:.3e} (mean over layers and positions)<br>"
        f"<small>TinyLM, {d['n_windows']} validation windows of {d['seq_len']} bytes; "
        f"logits: {how}</small>"
    )


def _below(values: np.ndarray, floor: float) -> int:
    return int((values < floor).sum())


class KVCacheExplorer(W.VBox):
    """Scheme dropdown -> attention-output error and KL along the sequence, readout.

    Attributes a test (or a curious learner) can drive: ``scheme`` (Dropdown); results in
    ``readout`` (HTML), ``image`` (PNG) and ``data`` (KVErrors.get's dict).
    """

    def __init__(self, scheme: str = "int4", model: TinyLM | None = None,
                 windows: torch.Tensor | None = None):
        scheme = kv.get_kv_scheme(scheme).name  # a clear error before any widget is built
        self.errors = KVErrors(model, windows)
        T = self.errors.windows.shape[1] - 1
        D = self.errors.model.cfg.head_dim
        options = [(f"{n} ({kv.bits_per_element(n, head_dim=D, seq_len=T):.2f} bits)", n)
                   for n in kv.KV_SCHEME_NAMES]
        self.scheme = W.Dropdown(options=options, value=scheme, description="KV cache",
                                 style={"description_width": "80px"},
                                 layout=W.Layout(width="360px"))
        self.readout = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(width="100%", max_width="900px"))
        self.scheme.add_class("qlab-kv-scheme")
        self.readout.add_class("qlab-readout")
        self.image.add_class("qlab-plot")
        self.data: dict = {}
        self._build_plot(self.errors.model.cfg.n_layer, T)
        super().__init__([self.scheme, self.readout, self.image])
        self.add_class("qlab-kv-explorer")
        self.scheme.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, _change=None) -> None:
        self.update()

    def update(self) -> dict:
        """Measure (first time only) and show the chosen scheme; returns its data."""
        name = self.scheme.value
        if not self.errors.measured(name) and kv.get_kv_scheme(name).window:
            self.readout.value = (f"measuring {name}: decoding token by token, a few "
                                  "seconds the first time ...")
        self.data = self.errors.get(name)
        self.readout.value = readout_html(self.data)
        self._draw()
        return self.data

    def _build_plot(self, n_layer: int, T: int) -> None:
        """Every artist once; _draw only sets their data (the Blitter redraws those)."""
        self._fig, (ax_a, ax_k) = new_figure(12.0, 4.2, ncols=2)
        self._fig.subplots_adjust(left=0.07, right=0.99, bottom=0.13, top=0.9, wspace=0.18)
        pos = np.arange(T)
        for ax, y_range in ((ax_a, ATTN_RANGE), (ax_k, KL_RANGE)):  # before any data:
            # NaN placeholders would trip a "no positive values" warning; zeros (the exact
            # positions of a float window) are left out, not drawn down to the axis
            ax.set_yscale("log", nonpositive="mask")
            ax.set_ylim(*y_range)
        self._attn_lines = [
            ax_a.plot(pos, np.full(T, np.nan), lw=1, label=f"layer {i}")[0]
            for i in range(n_layer)
        ]
        ax_a.set_xlim(0, T - 1)
        ax_a.set_xlabel("query position")
        ax_a.set_ylabel("‖attn out error‖ / ‖attn out‖")
        ax_a.grid(True, alpha=0.3)
        ax_a.legend(fontsize=8, loc="upper right", ncol=4)
        (self._kl_line,) = ax_k.plot(pos, np.full(T, np.nan), lw=0.7, color="tab:blue",
                                     alpha=0.45, label="each position")
        edges = np.arange(0, T + 1, BLOCK)
        self._kl_blocks = ax_k.stairs(np.full(T // BLOCK, np.nan), edges, baseline=None,
                                      lw=2, color="tab:blue", label=f"mean of {BLOCK} positions")
        (self._kl_mean,) = ax_k.plot([0, T - 1], [np.nan, np.nan], "--", color="tab:red",
                                     lw=1, label="mean")
        ax_k.set_xlim(0, T)
        ax_k.set_xlabel("position in the window")
        ax_k.set_ylabel("KL(float ‖ quantized cache), nats")
        ax_k.grid(True, alpha=0.3)
        ax_k.legend(fontsize=8, loc="upper right", ncol=3)
        self._notes = [ax.text(0.01, 0.02, "", transform=ax.transAxes, fontsize=8)
                       for ax in (ax_a, ax_k)]
        self._ax_attn, self._ax_kl = ax_a, ax_k
        self._blitter = Blitter(self._fig, [*self._attn_lines, self._kl_line, self._kl_blocks,
                                            self._kl_mean, *self._notes, ax_a.title, ax_k.title])

    def _draw(self) -> None:
        d = self.data
        for line, err in zip(self._attn_lines, d["attn"], strict=True):
            line.set_ydata(err)
        self._kl_line.set_ydata(d["kl"])
        self._kl_blocks.set_data(d["kl_blocks"])
        self._kl_mean.set_ydata([d["kl_mean"]] * 2)
        below_a = _below(d["attn"], ATTN_RANGE[0])
        below_k = _below(d["kl"], KL_RANGE[0])
        self._notes[0].set_text(f"{below_a} of {d['attn'].size} points below {ATTN_RANGE[0]:g}"
                                " (not drawn)" if below_a else "")
        self._notes[1].set_text(f"{below_k} of {d['kl'].size} positions below {KL_RANGE[0]:g}"
                                " (not drawn)" if below_k else "")
        self._ax_attn.set_title(f"{d['scheme']}: each layer's own cache error "
                                "(float q, k, v in)", fontsize=10)
        self._ax_kl.set_title(f"{d['scheme']}: next-byte KL, every layer's cache as stored",
                              fontsize=10)
        self.image.value = self._blitter.png()


def kv_explorer(scheme: str = "int4", model: TinyLM | None = None,
                windows: torch.Tensor | None = None) -> KVCacheExplorer:
    """The KV-cache explorer widget (leave it as the last expression of a cell).

    scheme: the first one shown (a name of qlab.kv.KV_SCHEME_NAMES); model: a TinyLM
    (default: the shipped checkpoint); windows: int64 (N, T + 1) with T a multiple of 32
    (default: 8 validation windows of 256 bytes).
    """
    return KVCacheExplorer(scheme, model, windows)
