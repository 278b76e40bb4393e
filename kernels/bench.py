"""Benchmark harness for the kernel labs: `python -m qlab.kernels.bench`.

On a CUDA GPU it times, for every layer shape and every batch size M in the sweep,

    torch_bf16       x @ W.T in bf16 (cuBLAS): the baseline
    w4a16            qlab.kernels.w4a16_linear (int4 weights, group 128)
    fp8              qlab.kernels.fp8_linear, end to end (activation quantization included)
    fp8_gemm         the FP8 GEMM alone (activations already quantized)
    torch_scaled_mm  torch._scaled_mm on the same fp8 operands and row/column scales

with triton.testing.do_bench, which clears the L2 cache before every run (it writes a
256 MB buffer), so weights come from HBM as they would in a real model. It reports
time, TFLOP/s, effective GB/s (every byte read and written, see count_bytes), the
percent of peak (bandwidth below the ridge point, tensor-core FLOP/s above it) and
speedups; writes JSON (GPU name, driver, torch and triton versions) and two plots,
a roofline and speedup versus M, under results/.

Without a GPU the kernels run on Triton's CPU interpreter, whose timings say nothing
about performance, so no time is measured: it runs a correctness pass against qlab
and evaluates the roofline MODEL for a datasheet GPU (--device), labelled as such.

Roofline: a kernel moving B bytes and doing F FLOPs takes at least
max(F / peak_flops, B / bandwidth). Its arithmetic intensity F / B against the
ridge point peak_flops / bandwidth says which bound applies.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

import qlab
from qlab.kernels import _backend
from qlab.kernels.dequant import dequantize_int4
from qlab.kernels.fp8 import fp8_linear, fp8_scaled_mm, pack_fp8, quantize_act_fp8
from qlab.kernels.w4a16 import pack_w4a16, w4a16_linear

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
GROUP_SIZE = 128  # W4A16 group size used throughout the benchmark
M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
M_QUICK = (1, 16, 128, 1024, 4096)

# (label, N = out_features, K = in_features): nn.Linear shapes of real models, from each
# model's config.json (hidden_size, intermediate_size, num_key_value_heads * head_dim).
SHAPES: tuple[tuple[str, int, int], ...] = (
    ("square 8192x8192", 8192, 8192),
    ("Llama-2-7B qkv", 12288, 4096),  # fused q, k, v: 3 x 4096
    ("Llama-2-7B o", 4096, 4096),
    ("Llama-2-7B gate/up", 11008, 4096),
    ("Llama-2-7B down", 4096, 11008),
    ("Llama-3-8B qkv", 6144, 4096),  # 4096 + 2 x 1024 (8 KV heads of 128)
    ("Llama-3-8B gate/up", 14336, 4096),
    ("Llama-3-8B down", 4096, 14336),
    ("Llama-2-70B qkv", 10240, 8192),  # 8192 + 2 x 1024 (8 KV heads of 128)
    ("Llama-2-70B gate/up", 28672, 8192),
    ("Llama-2-70B down", 8192, 28672),
)
SHAPES_QUICK = (SHAPES[0], SHAPES[3], SHAPES[4])

# Datasheet bandwidths and dense tensor-core peaks live in qlab.cost.DEVICES (one copy).
PEAK_FLOPS = {name: d.peak_flops for name, d in qlab.cost.DEVICES.items()}
# Which tensor-core peak bounds each kernel.
KERNEL_PRECISION = {
    "torch_bf16": "bf16",
    "w4a16": "bf16",
    "fp8": "fp8",
    "fp8_gemm": "fp8",
    "torch_scaled_mm": "fp8",
}


# ----------------------------------------------------------------------------- counting
def count_flops(m: int, n: int, k: int) -> int:
    """2 M N K: one multiply and one add per (m, n, k)."""
    return 2 * m * n * k


def count_bytes(kernel: str, m: int, n: int, k: int, group_size: int = GROUP_SIZE) -> int:
    """Every byte the kernel(s) read and write once (a lower bound on real traffic).

    bf16 activations and outputs are 2 bytes; packed int4 is K/2 bytes per row plus an
    fp16 scale per group; fp8 is 1 byte plus an fp32 scale per row or column.
    """
    x16, out16 = 2 * m * k, 2 * m * n
    if kernel == "torch_bf16":
        return x16 + 2 * n * k + out16
    if kernel == "w4a16":
        return x16 + n * k // 2 + 2 * n * (k // group_size) + out16
    gemm = m * k + n * k + 4 * (m + n) + out16  # fp8 x, fp8 W, scales, output
    if kernel in ("fp8_gemm", "torch_scaled_mm"):
        return gemm
    if kernel == "fp8":
        # + row scales: read x, write s_x; quantize: read x and s_x, write fp8 x
        return gemm + (x16 + 4 * m) + (x16 + 4 * m + m * k)
    raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNEL_PRECISION)}")


def device_spec(name: str) -> dict:
    """Datasheet peaks of a GPU called `name` (a qlab.cost.DEVICES key)."""
    if name not in PEAK_FLOPS:
        raise KeyError(f"no peak figures for {name!r}; known: {', '.join(PEAK_FLOPS)}")
    return {
        "name": name,
        "bandwidth_bytes_per_s": qlab.cost.DEVICES[name].bandwidth_bytes_per_s,
        "peak_flops": dict(PEAK_FLOPS[name]),
    }


def match_device(gpu_name: str) -> str | None:
    """Map torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3") to a table key."""
    name = gpu_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name and "PCIE" not in name:
        return "H100 SXM"
    if "A100" in name and "80GB" in name:
        return "A100 80GB"
    if "B200" in name:
        return "B200"
    if "4090" in name:
        return "RTX 4090"
    return None


def roofline_seconds(kernel: str, m: int, n: int, k: int, spec: dict) -> float:
    """Lower bound on the time: max(FLOPs / peak FLOP/s, bytes / bandwidth)."""
    peak = spec["peak_flops"][KERNEL_PRECISION[kernel]]
    compute = count_flops(m, n, k) / peak if peak else math.inf
    memory = count_bytes(kernel, m, n, k) / spec["bandwidth_bytes_per_s"]
    return max(compute, memory)


def ridge_intensity(spec: dict, precision: str = "bf16") -> float:
    """FLOPs per byte at which a kernel turns from bandwidth- to compute-bound."""
    return spec["peak_flops"][precision] / spec["bandwidth_bytes_per_s"]


def roofline_model(
    device: str = "H100 SXM",
    shapes=SHAPES,
    ms=M_SWEEP,
    kernels=("torch_bf16", "w4a16", "fp8"),
) -> dict:
    """The roofline model over shapes x M: times, intensities and speedups vs bf16."""
    spec = device_spec(device)
    rows = []
    for label, n, k in shapes:
        for m in ms:
            base = roofline_seconds("torch_bf16", m, n, k, spec)
            for kernel in kernels:
                if spec["peak_flops"][KERNEL_PRECISION[kernel]] is None:
                    continue  # e.g. no fp8 tensor cores on an A100
                t = roofline_seconds(kernel, m, n, k, spec)
                flops, nbytes = count_flops(m, n, k), count_bytes(kernel, m, n, k)
                rows.append(
                    {
                        "shape": label, "N": n, "K": k, "M": m, "kernel": kernel,
                        "time_s": t, "tflops": flops / t / 1e12, "gbps": nbytes / t / 1e9,
                        "intensity": flops / nbytes, "speedup_vs_bf16": base / t,
                    }
                )  # fmt: skip
    return {
        "kind": "roofline model (not measured)",
        "device": spec,
        "group_size": GROUP_SIZE,
        "rows": rows,
    }


def stops_paying_m(rows: list[dict], shape: str, kernel: str, gain: float = 1.1) -> int | None:
    """Smallest M at which `kernel` is less than `gain` x faster than bf16 (None: never)."""
    for row in sorted(rows, key=lambda r: r["M"]):
        if row["shape"] == shape and row["kernel"] == kernel and row["speedup_vs_bf16"] < gain:
            return row["M"]
    return None


# ----------------------------------------------------------------------------- GPU runs
@dataclass
class Measurement:
    shape: str
    N: int
    K: int
    M: int
    kernel: str
    time_s: float
    tflops: float
    gbps: float
    intensity: float
    pct_peak: float | None  # of the bound that applies (bandwidth or FLOP/s)
    bound: str  # "memory" | "compute" by the roofline
    speedup_vs_bf16: float | None = None
    speedup_vs_scaled_mm: float | None = None
    max_rel_err: float | None = None


def environment() -> dict:
    """GPU name, driver, CUDA, torch and triton versions for the JSON header."""
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "driver": None,
    }
    if _backend.HAS_CUDA:
        env["gpu"] = torch.cuda.get_device_name()
        env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            )  # fmt: skip
            env["driver"] = smi.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = "unknown (nvidia-smi unavailable)"
    return env


def _measure(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median seconds of fn over rep_ms of runs; do_bench flushes L2 before each one."""
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3


def _candidates(x, w_bf16, packed4, packed8, q_x, s_x) -> dict:
    fns = {
        "torch_bf16": lambda: torch.nn.functional.linear(x, w_bf16),
        "w4a16": lambda: w4a16_linear(x, packed4),
    }
    if packed8 is not None:
        fns["fp8"] = lambda: fp8_linear(x, packed8)
        fns["fp8_gemm"] = lambda: fp8_scaled_mm(q_x, s_x, packed8, torch.bfloat16)
        b = packed8.codes.T  # (K, N) column-major, the layout _scaled_mm wants
        sa, sb = s_x[:, None], packed8.scales[None, :]
        fns["torch_scaled_mm"] = lambda: torch._scaled_mm(
            q_x, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
        )
    return fns


def run_gpu(shapes=SHAPES, ms=M_SWEEP, rep_ms: int = 100) -> dict:
    """Time every kernel on every shape and M (needs CUDA). Returns the JSON document."""
    from tqdm.auto import tqdm

    env = environment()
    table_name = match_device(env["gpu"])
    spec = device_spec(table_name) if table_name else None
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)
    rows: list[Measurement] = []
    skipped: dict[str, str] = {}
    progress = tqdm(total=len(shapes) * len(ms), desc="bench", unit="case")
    for label, n, k in shapes:
        torch.manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed4 = pack_w4a16(w, GROUP_SIZE)
        packed8 = pack_fp8(w, "channel") if fp8_ok else None
        w4_hat = dequantize_int4(packed4.packed, packed4.scales, GROUP_SIZE)  # on the GPU
        for m in ms:
            progress.set_postfix_str(f"{label} M={m}")
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q_x, s_x = quantize_act_fp8(x) if fp8_ok else (None, None)
            fns = _candidates(x, w, packed4, packed8, q_x, s_x)
            times = {}
            for name, fn in fns.items():
                try:
                    times[name] = _measure(fn, rep_ms=rep_ms)
                except (RuntimeError, TypeError, ValueError) as err:  # e.g. no rowwise _scaled_mm
                    skipped.setdefault(name, f"{type(err).__name__}: {err}"[:300])
            # A loose sanity check of the kernels' answers (the tests hold the tight ones).
            ref = x.float() @ w4_hat.T
            err4 = float((w4a16_linear(x, packed4).float() - ref).norm() / ref.norm())
            for name, t in times.items():
                flops, nbytes = count_flops(m, n, k), count_bytes(name, m, n, k)
                bound, pct = "memory", None
                if spec is not None:
                    peak = spec["peak_flops"][KERNEL_PRECISION[name]]
                    if peak and flops / nbytes > peak / spec["bandwidth_bytes_per_s"]:
                        bound, pct = "compute", 100 * flops / t / peak
                    else:
                        pct = 100 * nbytes / t / spec["bandwidth_bytes_per_s"]
                rows.append(
                    Measurement(
                        shape=label, N=n, K=k, M=m, kernel=name, time_s=t,
                        tflops=flops / t / 1e12, gbps=nbytes / t / 1e9,
                        intensity=flops / nbytes, pct_peak=pct, bound=bound,
                        speedup_vs_bf16=times["torch_bf16"] / t if "torch_bf16" in times else None,
                        speedup_vs_scaled_mm=(
                            times["torch_scaled_mm"] / t
                            if name.startswith("fp8") and "torch_scaled_mm" in times
                            else None
                        ),
                        max_rel_err=err4 if name == "w4a16" else None,
                    )
                )  # fmt: skip
            progress.update(1)
    progress.close()
    return {
        "kind": "measured",
        "environment": env,
        "device": spec,
        "group_size": GROUP_SIZE,
        "timing": "triton.testing.do_bench, median, L2 flushed before each run",
        "skipped": skipped,
        "rows": [asdict(r) for r in rows],
    }


# ----------------------------------------------------------------------------- CPU runs
def correctness_pass() -> list[dict]:
    """Small shapes through the kernels (interpreter on a CPU) against qlab."""
    from qlab.pipelines import w4a16_reference, w8a8_reference

    dev = _backend.DEVICE
    torch.manual_seed(0)
    checks = []
    w = torch.randn(96, 256) * 0.05
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    qt = qlab.quantize(w, "int4", GROUP_SIZE)
    got = dequantize_int4(qlab.pack_int4(qt.codes).to(dev), qt.scales.to(dev), GROUP_SIZE)
    checks.append(
        {"kernel": "dequant", "bit_exact": bool(torch.equal(got.cpu(), qlab.dequantize(qt)))}
    )
    for m in (1, 5):
        ref = w4a16_reference(x[:m], w, GROUP_SIZE)
        y = w4a16_linear(x[:m].to(dev), pack_w4a16(w.to(dev), GROUP_SIZE)).float().cpu()
        rel = float((y - ref).norm() / ref.norm())
        checks.append({"kernel": f"w4a16 M={m}", "rel_err": rel, "ok": rel < 2.0**-7})
    ref = w8a8_reference(x, w)
    y = fp8_linear(x.to(dev), pack_fp8(w.to(dev))).float().cpu()
    rel = float((y - ref).norm() / ref.norm())
    checks.append({"kernel": "fp8 M=5", "rel_err": rel, "ok": rel < 2.0**-7})
    return checks


# ----------------------------------------------------------------------------- plots
def plot_roofline(doc: dict, path: Path | None = None, m_marks=(1, 16, 128, 1024, 4096)):
    """Roofline: attainable TFLOP/s against FLOPs per byte, with the kernels' points."""
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
    shape = doc["rows"][0]["shape"] if doc["rows"] else None
    for kernel, color in (("torch_bf16", "C0"), ("w4a16", "C1"), ("fp8", "C2")):
        pts = [r for r in doc["rows"] if r["shape"] == shape and r["kernel"] == kernel]
        pts = [r for r in pts if r["M"] in m_marks]
        if pts:
            ax.plot([r["intensity"] for r in pts], [r["tflops"] for r in pts], "o-", color=color,
                    label=kernel)  # fmt: skip
            for r in pts if kernel == "w4a16" else ():  # label one series: less clutter
                ax.annotate(f"M={r['M']}", (r["intensity"], r["tflops"]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("TFLOP/s")
    measured = doc["kind"] == "measured"
    where = doc.get("environment", {}).get("gpu") if measured else spec["name"]
    ax.set_title(f"{'Measured' if measured else 'MODEL, not measured'}: {shape} on {where}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def plot_speedup(doc: dict, path: Path | None = None):
    """Speedup over torch bf16 against batch size M, one line per shape and kernel."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    shapes = sorted({r["shape"] for r in doc["rows"]})
    for i, shape in enumerate(shapes):
        for kernel, style in (("w4a16", "o-"), ("fp8", "s--")):
            pts = sorted(
                (r for r in doc["rows"] if r["shape"] == shape and r["kernel"] == kernel),
                key=lambda r: r["M"],
            )
            if pts and pts[0].get("speedup_vs_bf16") is not None:
                ax.plot([r["M"] for r in pts], [r["speedup_vs_bf16"] for r in pts], style,
                        color=f"C{i % 10}", ms=3, label=f"{kernel} {shape}")  # fmt: skip
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size M (tokens)")
    ax.set_ylabel("speedup over torch bf16")
    measured = doc["kind"] == "measured"
    where = doc.get("environment", {}).get("gpu") if measured else doc["device"]["name"]
    ax.set_title(f"{'Measured' if measured else 'MODEL, not measured'} on {where}")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


# ----------------------------------------------------------------------------- results
def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def save(doc: dict, out_dir: Path, stem: str, plots: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json"]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    if plots:
        paths.append(out_dir / f"{stem}_roofline.png")
        plot_roofline(doc, paths[-1])
        paths.append(out_dir / f"{stem}_speedup.png")
        plot_speedup(doc, paths[-1])
    return paths


def latest_measured(results_dir: Path = RESULTS_DIR) -> dict | None:
    """The newest recorded GPU run under results/ (None if there is none yet)."""
    docs = []
    for p in sorted(results_dir.glob("bench_*.json")):
        doc = json.loads(p.read_text())
        if doc.get("kind") == "measured":
            docs.append((doc["environment"]["date_utc"], doc))
    return max(docs, key=lambda d: d[0])[1] if docs else None


def summary_lines(doc: dict) -> list[str]:
    """A few lines of plain text: the table a reader looks at first."""
    lines = []
    label = "MEASURED" if doc["kind"] == "measured" else "ROOFLINE MODEL (not measured)"
    lines.append(f"{label}, device: {doc['device']['name'] if doc['device'] else '?'}")
    lines.append(f"{'shape':<22}{'M':>6} {'kernel':<16}{'time us':>10}{'TFLOP/s':>9}"
                 f"{'GB/s':>8}{'x bf16':>8}")  # fmt: skip
    for r in doc["rows"]:
        sp = r.get("speedup_vs_bf16")
        lines.append(
            f"{r['shape']:<22}{r['M']:>6} {r['kernel']:<16}{r['time_s'] * 1e6:>10.1f}"
            f"{r['tflops']:>9.1f}{r['gbps']:>8.0f}{(f'{sp:.2f}' if sp else '-'):>8}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qlab.kernels.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="3 shapes, M in 1,16,128,1024,4096")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--device", default="H100 SXM", choices=sorted(PEAK_FLOPS),
                        help="datasheet GPU for the roofline model without a GPU")  # fmt: skip
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench time per case")
    args = parser.parse_args(argv)
    shapes = SHAPES_QUICK if args.quick else SHAPES
    ms = M_QUICK if args.quick else M_SWEEP

    if _backend.HAS_CUDA and not _backend.INTERPRET:
        doc = run_gpu(shapes, ms, rep_ms=args.rep_ms)
        stem = f"bench_{_slug(doc['environment']['gpu'])}_{doc['environment']['date_utc'][:10]}"
        paths = save(doc, args.out, stem, plots=not args.no_plots and doc["device"] is not None)
        print("\n".join(summary_lines(doc)))
    else:
        print("No CUDA GPU: correctness pass on the Triton CPU interpreter, then the roofline")
        print("MODEL. Interpreter timings are not performance, so none are reported.")
        checks = correctness_pass()
        for c in checks:
            print("  ", c)
        doc = roofline_model(args.device, shapes, ms)
        doc["correctness"] = checks
        stem = f"roofline_model_{_slug(args.device)}"
        paths = save(doc, args.out, stem, plots=not args.no_plots)
        for label, *_ in shapes:
            m_stop = stops_paying_m(doc["rows"], label, "w4a16")
            print(f"   model, {label}: W4A16 gains under 10% over bf16 from M = {m_stop}")
        failed = [c for c in checks if not c.get("ok", c.get("bit_exact"))]
        if failed:
            print("CORRECTNESS FAILED:", failed, file=sys.stderr)
            return 1
    for p in paths:
        print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
