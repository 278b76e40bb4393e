"""The decode & KV-cache calculator: what bit width buys at serving time.

Pick a model, a weight bit width and group size, a KV-cache bit width, a context
length and a device: the calculator shows the weight memory, how many devices
the weights need, the batch-1 decode ceiling (tokens/s = bandwidth / weight
bytes), the memory left for KV cache, and how many sequences fit in it. All the
arithmetic is qlab.cost's; ``decode_summary`` returns it as plain data and
``DecodeCalculator`` displays it (HTML only: no plot, so every update is cheap).
"""

from __future__ import annotations

import math

import ipywidgets as W

from qlab import cost

__all__ = ["DecodeCalculator", "decode_summary", "summary_html"]

WEIGHT_BITS = (16, 8, 6, 5, 4, 3, 2)
GROUP_SIZES = (None, 256, 128, 64, 32)  # None: one scale per tensor/channel (no overhead)
KV_BITS = (16, 8, 4)
CONTEXTS = (2048, 4096, 8192, 32768, 131072)
SCALE_BITS = 16  # fp16 scale per group
GB = 1e9  # decimal, as qlab.cost and datasheets count


def decode_summary(
    model: str | cost.ModelConfig,
    weight_bits: int = 4,
    group_size: int | None = 128,
    device: str | cost.Device = "H100 SXM",
    context_len: int = 4096,
    kv_bits: int = 16,
    reserve_gb: float = 0.0,
) -> dict:
    """Serving arithmetic of one configuration, from qlab.cost.

    Quantized weights (weight_bits < 16) carry, per group of ``group_size``, a 16-bit
    scale and a zero point of ``weight_bits`` bits (GPTQ checkpoints store one per group
    even for a symmetric grid; AWQ's are asymmetric): 4-bit g128 is 4 + 16/128 + 4/128 =
    4.156 bits/weight. 16-bit weights carry nothing.
    The weights are split over the fewest devices that hold them (tensor parallel),
    so the bandwidth and the memory of all of them add up.

    Returns a dict of plain numbers: bits_per_weight, weight_bytes, n_devices,
    tokens_per_s (batch-1 ceiling, weights only), tokens_per_s_per_device,
    memory_left_bytes, kv_bytes_per_token, kv_bytes_per_sequence, concurrent_sequences,
    tokens_per_s_each_full and tokens_per_s_total_full (every one of the concurrent
    sequences decoding at full context: each step reads the weights and all their KV
    caches; None when none fits), plus the names and inputs.
    """
    m = cost.MODELS[model] if isinstance(model, str) else model
    d = cost.DEVICES[device] if isinstance(device, str) else device
    if weight_bits >= 16:
        bpw = cost.bits_per_weight(weight_bits)
    else:
        bpw = cost.bits_per_weight(
            weight_bits, group_size, scale_bits=SCALE_BITS, zero_bits=weight_bits
        )
    w_bytes = cost.weight_bytes(m.n_params, bpw)
    reserve = reserve_gb * GB
    # the fewest devices that hold the weights with some room left (exactly full: one more)
    n_devices = math.floor((w_bytes + reserve) / d.memory_bytes) + 1
    tokens_per_s = cost.decode_ceiling_tokens_per_s(w_bytes, n_devices * d.bandwidth_bytes_per_s)
    kv_token = cost.kv_cache_bytes_per_token(m, kv_bits)
    seqs = cost.max_concurrent_sequences(
        m, bpw, d, context_len, kv_bits=kv_bits, n_devices=n_devices, reserve_bytes=reserve
    )
    each_full = None
    if seqs:
        each_full = cost.decode_ceiling_per_sequence(
            w_bytes, kv_token * context_len, seqs, n_devices * d.bandwidth_bytes_per_s
        )
    return {
        "model": m.name,
        "device": d.name,
        "weight_bits": weight_bits,
        "group_size": group_size if weight_bits < 16 else None,
        "kv_bits": kv_bits,
        "context_len": context_len,
        "bits_per_weight": bpw,
        "weight_bytes": w_bytes,
        "n_devices": n_devices,
        "device_memory_bytes": d.memory_bytes,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / n_devices,
        "memory_left_bytes": n_devices * d.memory_bytes - w_bytes - reserve,
        "reserve_bytes": reserve,
        "kv_bytes_per_token": kv_token,
        "kv_bytes_per_sequence": kv_token * context_len,
        "concurrent_sequences": seqs,
        "tokens_per_s_each_full": each_full,
        "tokens_per_s_total_full": None if each_full is None else each_full * seqs,
    }


def _bar(s: dict) -> str:
    """A stacked memory bar (weights | reserve | KV in use | free), HTML only."""
    total = s["n_devices"] * s["device_memory_bytes"]
    kv_used = s["concurrent_sequences"] * s["kv_bytes_per_sequence"]
    parts = [
        (s["weight_bytes"], "#4c72b0", "weights"),
        (s["reserve_bytes"], "#999999", "reserve"),
        (kv_used, "#dd8452", "KV cache"),
    ]
    divs = "".join(
        f"<div title='{label}' style='width:{100 * b / total:.2f}%;background:{colour};'></div>"
        for b, colour, label in parts
        if b > 0
    )
    return (
        "<div style='display:flex;height:18px;width:100%;max-width:560px;"
        f"border:1px solid #555;background:#eee'>{divs}</div>"
        "<div style='font-size:85%'><span style='color:#4c72b0'>■</span> weights "
        "<span style='color:#dd8452'>■</span> KV cache of the concurrent sequences "
        "<span style='color:#999'>■</span> reserve · grey: free</div>"
    )


def summary_html(s: dict) -> str:
    """The calculator's readout for a decode_summary dict."""
    g = "" if s["group_size"] is None else f", group {s['group_size']}"
    dev = f"{s['n_devices']} × {s['device']}"
    rows = [
        ("weights", f"{s['weight_bytes'] / GB:.1f} GB at {s['bits_per_weight']:.3f} bits/weight"),
        ("needs", f"{dev} ({s['device_memory_bytes'] / GB:.0f} GB each)"),
        (
            "decode ceiling (batch 1)",
            f"<b>{s['tokens_per_s']:.1f} tokens/s</b> "
            f"({s['tokens_per_s_per_device']:.1f} per device)",
        ),
        ("memory left for KV cache", f"<b>{s['memory_left_bytes'] / GB:.1f} GB</b>"),
        (
            "KV cache",
            f"{s['kv_bytes_per_token'] / 1e3:.1f} kB/token at {s['kv_bits']} bit → "
            f"{s['kv_bytes_per_sequence'] / GB:.2f} GB per {s['context_len']}-token sequence",
        ),
        ("concurrent sequences", f"<b>{s['concurrent_sequences']}</b>"),
    ]
    if s["tokens_per_s_each_full"] is not None:
        rows.append((
            "all of them decoding",
            f"{s['tokens_per_s_each_full']:.1f} tokens/s each, "
            f"<b>{s['tokens_per_s_total_full']:.0f} tokens/s</b> in total",
        ))
    body = "".join(f"<tr><td style='padding-right:1em'>{k}</td><td>{v}</td></tr>" for k, v in rows)
    title = f"<b>{s['model']}</b>, {s['weight_bits']}-bit weights{g}, on {dev}"
    return f"<div>{title}<table>{body}</table>{_bar(s)}</div>"


class DecodeCalculator(W.VBox):
    """Model/bits/group/device presets -> ceiling tokens/s, memory left, sequences."""

    def __init__(
        self,
        model: str = "Llama-3-70B",
        weight_bits: int = 4,
        group_size: int | None = 128,
        device: str = "H100 SXM",
        context_len: int = 4096,
        kv_bits: int = 16,
    ):
        style = {"description_width": "120px"}
        self.model = W.Dropdown(
            options=list(cost.MODELS), value=model, description="model", style=style
        )
        self.weight_bits = W.Dropdown(
            options=list(WEIGHT_BITS), value=weight_bits, description="weight bits", style=style
        )
        self.group_size = W.Dropdown(
            options=[("per channel (none)", None)] + [(str(g), g) for g in GROUP_SIZES[1:]],
            value=group_size,
            description="group size",
            style=style,
        )
        self.device = W.Dropdown(
            options=list(cost.DEVICES), value=device, description="device", style=style
        )
        self.context_len = W.Dropdown(
            options=list(CONTEXTS), value=context_len, description="context (tokens)", style=style
        )
        self.kv_bits = W.Dropdown(
            options=list(KV_BITS), value=kv_bits, description="KV-cache bits", style=style
        )
        self.readout = W.HTML()
        self.readout.add_class("qlab-readout")
        self.data: dict = {}
        controls = W.HBox(
            [
                W.VBox([self.model, self.weight_bits, self.group_size]),
                W.VBox([self.device, self.context_len, self.kv_bits]),
            ]
        )
        super().__init__([controls, self.readout])
        self.add_class("qlab-decode-calculator")
        for c in (
            self.model,
            self.weight_bits,
            self.group_size,
            self.device,
            self.context_len,
            self.kv_bits,
        ):
            c.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, _change=None) -> None:
        self.update()

    def update(self) -> dict:
        self.group_size.disabled = self.weight_bits.value >= 16
        self.data = decode_summary(
            self.model.value,
            self.weight_bits.value,
            self.group_size.value,
            self.device.value,
            self.context_len.value,
            self.kv_bits.value,
        )
        self.readout.value = summary_html(self.data)
        return self.data
