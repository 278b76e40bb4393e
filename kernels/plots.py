"""The benchmark's two figures, drawn from a results document (kernels/bench.py writes them).

Each figure plots rows that are already computed (measured, or the roofline model's): it
derives nothing itself except the roofs, which come from the document's device figures.
A document is {"kind": "measured" | "roofline model (not measured)", "device": {...},
"environment": {...} (measured only), "rows": [{shape, M, kernel, intensity, tflops,
speedup_vs_bf16, ...}]}.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_roofline", "plot_speedup", "title"]

SERIES = (("torch_bf16", "C0", "o-"), ("w4a16", "C1", "o-"), ("tinygemm", "C3", "^--"),
          ("fp8", "C2", "s-"), ("torch_fp8", "C4", "v--"))  # fmt: skip


def title(doc: dict) -> str:
    """'Measured on <GPU>' or 'MODEL, not measured: <device>': every figure says which."""
    if doc["kind"] == "measured":
        return f"Measured on {doc.get('environment', {}).get('gpu')}"
    return f"MODEL, not measured: {doc['device']['name']}"


def plot_roofline(doc: dict, path: Path | None = None, shape: str | None = None,
                  m_marks=(1, 16, 128, 1024, 4096), issue: dict | None = None):  # fmt: skip
    """Attainable TFLOP/s against FLOPs per byte: the roofs and each kernel's points.

    issue: {label: (thread-instructions per second, SASS instructions per byte)} draws an
    instruction-issue roof per entry (kernels/roofline.py issue_rate): a kernel issuing that
    many instructions per byte streams at most rate / instructions bytes per second."""
    from matplotlib.figure import Figure

    spec = doc["device"]
    bw = spec["bandwidth_bytes_per_s"]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    xs = [2.0**e for e in range(-2, 14)]
    for precision, style in (("bf16", "-"), ("fp8", "--")):
        peak = spec["peak_flops"].get(precision)
        if peak:
            ax.plot(xs, [min(peak, bw * i) / 1e12 for i in xs], "k" + style, lw=1,
                    label=f"{precision} roof")  # fmt: skip
    for (label, (rate, per_byte)), color in zip((issue or {}).items(), ("C5", "C6", "C7"),
                                                strict=False):  # fmt: skip
        peak = spec["peak_flops"]["bf16"]
        ax.plot(xs, [min(peak, rate / per_byte * i) / 1e12 for i in xs], ":", color=color,
                lw=1.5, label=f"issue roof: {label}, {per_byte:.1f} instr/byte")  # fmt: skip
    shape = shape or (doc["rows"][0]["shape"] if doc["rows"] else None)
    for kernel, color, style in SERIES:
        pts = [r for r in doc["rows"] if r["shape"] == shape and r["kernel"] == kernel
               and r["M"] in m_marks and r.get("tflops")]  # fmt: skip
        if pts:
            ax.plot([r["intensity"] for r in pts], [r["tflops"] for r in pts], style,
                    color=color, label=kernel)  # fmt: skip
            for r in pts if kernel == "w4a16" else ():  # label one series: less clutter
                ax.annotate(f"M={r['M']}", (r["intensity"], r["tflops"]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{title(doc)}: {shape}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_speedup(doc: dict, path: Path | None = None, kernels=("w4a16", "fp8")):
    """Speedup over torch bf16 against batch size M, one line per shape and kernel."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    shapes = list(dict.fromkeys(r["shape"] for r in doc["rows"]))
    styles = {"w4a16": "o-", "fp8": "s--", "tinygemm": "^:", "torch_fp8": "v:"}
    for i, shape in enumerate(shapes):
        for kernel in kernels:
            pts = sorted((r for r in doc["rows"] if r["shape"] == shape and r["kernel"] == kernel
                          and r.get("speedup_vs_bf16")), key=lambda r: r["M"])  # fmt: skip
            if pts:
                ax.plot([r["M"] for r in pts], [r["speedup_vs_bf16"] for r in pts],
                        styles.get(kernel, "o-"), color=f"C{i % 10}", ms=3,
                        label=f"{kernel} {shape}")  # fmt: skip
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size M (tokens)")
    ax.set_ylabel("speedup over torch bf16")
    ax.set_title(title(doc), fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
