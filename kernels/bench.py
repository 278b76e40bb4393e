"""Benchmark harness for the kernel labs: `python -m qlab.kernels.bench [--quick]`.

On a CUDA GPU, for every layer shape and batch size M, every candidate of
kernels/baselines.py (our W4A16 and FP8 kernels; torch bf16, tinygemm, dequantize-then-
bf16, torch._scaled_mm both accumulation modes, GEMM-only and end to end) is

  1. run once (compiling and autotuning) and CHECKED against qlab (kernels/tolerance.py);
     a wrong output is recorded and never timed;
  2. timed, median of many runs, with weights read from HBM, never from L2:
     triton.testing.do_bench, which flushes the L2 cache before every run; and, where that
     gives under CUDAGRAPH_BELOW_S (launch overhead would dominate), do_bench_cudagraph on
     a CUDA graph that cycles through enough copies of the weights to overflow L2;
  3. put beside the roofline model's expected time for the matched datasheet device
     (kernels/roofline.py: a model, a lower bound), with the bound that applies and the
     percent of it achieved; speedups over bf16 and over the matching baseline.

Results are rewritten to results/bench_<GPU>_<date>.json after every (shape, M), with
the git commit (or a hash of kernels/), GPU clocks, versions and each launch's grid and
config; two plots at the end (kernels/plots.py). Without a GPU the same loop runs every
candidate the CPU can (the Triton interpreter) on small shapes, checked, NOT timed
(interpreter timings measure numpy), and the roofline MODEL is written, labelled as such.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import triton

import qlab
from qlab.kernels import _backend, baselines, configs, plots, roofline

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
GROUP_SIZE = 128  # W4A16 group size used throughout the benchmark
CUDAGRAPH_BELOW_S = 50e-6  # below this, time a CUDA graph (launch overhead would dominate)
MAX_WEIGHT_COPIES = 64
M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
M_QUICK = (1, 16, 64, 256, 4096)
M_CPU = (1, 5, 130)  # decode, small and large buckets, on the interpreter

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
SHAPES_QUICK = (SHAPES[2], SHAPES[10], SHAPES[6])  # 4096x4096, 8192x28672, 14336x4096
SHAPES_CPU = (("tiny 96x256", 96, 256),)
BASELINE_OF = {  # like-for-like comparisons: our kernel -> the baseline doing the same work
    "w4a16": "tinygemm",
    "fp8": "torch_fp8",
    "fp8_fast": "torch_fp8_fast",
    "fp8_gemm": "torch_scaled_mm",
    "fp8_gemm_fast": "torch_scaled_mm_fast",
}
OURS = ("w4a16", "fp8", "fp8_fast", "fp8_gemm", "fp8_gemm_fast")


# ----------------------------------------------------------------------------- environment
def match_device(gpu_name: str | None) -> str | None:
    """torch.cuda.get_device_name() -> a qlab.cost.DEVICES key, or None (no guess: an
    "H100 NVL", "H100 PCIe", "H200 NVL" or "GH200" has other bandwidth or clocks)."""
    name = (gpu_name or "").upper()
    if "GH200" in name:  # 96 GB HBM3 at 4 TB/s, or 144 GB HBM3e at 4.9 TB/s
        key = "GH200 144GB" if "144G" in name else "GH200"
    elif "NVL" in name:
        key = "H200 NVL" if "H200" in name else "H100 NVL" if "H100" in name else None
    elif "H200" in name:
        key = "H200"
    elif "H100" in name:
        key = None if "PCIE" in name else "H100 SXM"
    elif "A100" in name:
        key = "A100 80GB" if "80GB" in name else None
    elif "B200" in name:
        key = "B200"
    elif "4090" in name:
        key = "RTX 4090"
    elif "L40S" in name:
        key = "L40S"
    elif name.split()[-1:] == ["L4"]:
        key = "L4"
    else:
        key = None
    return key if key in qlab.cost.DEVICES else None


def source_version() -> dict:
    """The git commit (QLAB_GIT_COMMIT when there is no .git) and a hash of kernels/."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    commit = os.environ.get("QLAB_GIT_COMMIT")
    try:
        git = ["git", "-C", str(root.parent)]
        commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()  # fmt: skip
        status = git + ["status", "--porcelain", "--", "kernels"]
        dirty = subprocess.run(status, capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return {"git_commit": commit, "kernels_sha256": digest.hexdigest()[:16]}


CLOCK_FIELDS = ("clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw",
                "power.limit", "temperature.gpu", "pstate")  # fmt: skip


def gpu_clocks(fields=CLOCK_FIELDS) -> dict | None:
    """Current and max SM/memory clocks (MHz), power (W), temperature (C) from nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(fields, (v.strip() for v in out.split(",")), strict=False))


def environment() -> dict:
    """Date, versions, GPU, driver, SMs, L2 size, clocks, source version: the JSON header."""
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        **source_version(),
    }
    if _backend.HAS_CUDA:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=props.name, sms=props.multi_processor_count,
                   compute_capability=f"{props.major}.{props.minor}",
                   l2_bytes=getattr(props, "L2_cache_size", None), clocks=gpu_clocks())  # fmt: skip
        env["driver"] = (gpu_clocks(("driver_version",)) or {}).get("driver_version")
    return env


# ----------------------------------------------------------------------------- timing
def time_calls(calls: list, rep_ms: int) -> tuple[float, str]:
    """Median seconds of calls[0](); below CUDAGRAPH_BELOW_S, a CUDA graph cycling calls
    (one per weight copy, so the weights come from HBM) divided by len(calls)."""
    t = triton.testing.do_bench(calls[0], warmup=10, rep=rep_ms, return_mode="median") / 1e3
    if t >= CUDAGRAPH_BELOW_S:
        return t, "do_bench (L2 flushed)"

    def cycle():
        for call in calls:
            call()

    t = triton.testing.do_bench_cudagraph(cycle, rep=rep_ms, return_mode="median") / 1e3
    return t / len(calls), f"cudagraph, {len(calls)} weight copies (L2 cold)"


def weight_copies(weight_bytes: int, l2_bytes: int | None) -> int:
    """Copies of a weight whose rotation overflows L2 three times over."""
    if not l2_bytes:
        return 1
    return max(1, min(MAX_WEIGHT_COPIES, math.ceil(3 * l2_bytes / weight_bytes)))


def _clone(w: baselines.Weights) -> baselines.Weights:
    """Same values at new addresses (the references are shared)."""
    same = lambda t: None if t is None else t.clone()  # noqa: E731
    w8 = w.w8 and w.w8._replace(codes=w.w8.codes.clone(), scales=w.w8.scales.clone())
    tiny = w.tinygemm and tuple(t.clone() for t in w.tinygemm)
    w4 = w.w4._replace(packed=w.w4.packed.clone(), scales=w.w4.scales.clone())
    return baselines.Weights(same(w.bf16), w4, w.w4_hat, tiny, w8, w.w8_hat)


# ----------------------------------------------------------------------------- one case
def measure(cand, ref, copies: list, timed: bool, rep_ms: int, l2: int | None) -> dict:
    """Run, check and (timed) time one candidate on ref.x; the row's measurement fields."""
    x, w = ref.x, copies[0]
    try:
        args = cand.setup(x, w)
        if timed:
            cand.fn(*args)  # compile and autotune first: record one plain call below
        with configs.recording() as launched:
            y = cand.fn(*args)
        problem = cand.check(y, ref)
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as err:
        return {"skipped": f"{type(err).__name__}: {err}"[:300]}
    row = {"launches": [lc.describe() for lc in launched]}
    if problem:
        return {**row, "error": problem}
    if timed:
        n = weight_copies(cand.weight_bytes(w), l2)
        while len(copies) < n:
            copies.append(_clone(w))
        calls = [functools.partial(cand.fn, *cand.setup(x, c)) for c in copies[:n]]
        row["time_s"], row["timing"] = time_calls(calls, rep_ms)
    return row


def _base(kernel: str) -> str:
    return kernel.removesuffix("_fast")


def finish_rows(rows: list[dict], spec) -> None:
    """Add model, bound and speedup columns to the rows of one (shape, M)."""
    times = {r["kernel"]: r.get("time_s") for r in rows}
    for r in rows:
        t = r.get("time_s")
        m, n, k = r["M"], r["N"], r["K"]
        r["intensity"] = roofline.flops(m, n, k) / roofline.bytes_moved(_base(r["kernel"]), m, n, k)
        if spec is not None:
            b = roofline.bound(_base(r["kernel"]), m, n, k, spec, seconds=t)
            r.update(expected_s=b.seconds, bound=b.kind, pct_of_bound=b.percent)
        if not t:
            continue
        r["tflops"] = roofline.flops(m, n, k) / t / 1e12
        r["gbps"] = roofline.bytes_moved(_base(r["kernel"]), m, n, k) / t / 1e9
        if times.get("torch_bf16"):
            r["speedup_vs_bf16"] = times["torch_bf16"] / t
        base = BASELINE_OF.get(r["kernel"])
        if base and times.get(base):
            r["baseline"], r["speedup_vs_baseline"] = base, times[base] / t


def run(shapes, ms, out_path: Path | None, timed: bool, rep_ms: int = 50) -> dict:
    """The sweep: every candidate on every shape and M; the doc is rewritten to out_path
    after every (shape, M), so an interrupted run keeps what it measured."""
    device = _backend.DEVICE
    env = environment()
    table = match_device(env["gpu"]) if timed else None
    spec = qlab.cost.DEVICES[table] if table else None
    native = _backend.HAS_CUDA and not _backend.INTERPRET
    fp8_ok = not native or torch.cuda.get_device_capability() >= (8, 9)
    doc = {
        "kind": "measured" if timed else "correctness (CPU interpreter; not timed)",
        "environment": env,
        "device": _device_dict(spec) if spec else None,
        "group_size": GROUP_SIZE,
        "timing": f"median; do_bench with L2 flush, CUDA graph with L2-cold weight copies "
                  f"below {CUDAGRAPH_BELOW_S * 1e6:.0f} us",
        "rows": [],
        "clocks_per_shape": [],
    }  # fmt: skip
    for label, n, k in shapes:
        torch.manual_seed(0)
        weight = (torch.randn(n, k) * 0.02).to(device, torch.bfloat16)
        copies = [baselines.prepare(weight, GROUP_SIZE, fp8_ok)]
        doc["clocks_per_shape"].append({"shape": label, "clocks": gpu_clocks() if timed else None})
        for m in ms:
            x = torch.randn(m, k, device=device).to(torch.bfloat16)
            ref = baselines.Reference(x, copies[0])
            rows = []
            for cand in baselines.candidates(fp8_ok):
                row = {"shape": label, "N": n, "K": k, "M": m, "kernel": cand.name}
                row.update(measure(cand, ref, copies, timed, rep_ms, env.get("l2_bytes")))
                rows.append(row)
            finish_rows(rows, spec)
            doc["rows"] += rows
            if out_path is not None:
                _write(doc, out_path)
        del copies, ref
    return doc


def _device_dict(spec) -> dict:
    return {"name": spec.name, "bandwidth_bytes_per_s": spec.bandwidth_bytes_per_s,
            "peak_flops": dict(spec.peak_flops)}  # fmt: skip


def _write(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)  # atomic: a reader never sees half a file


# ----------------------------------------------------------------------------- reading
def failures(doc: dict) -> list[dict]:
    """Rows of OUR kernels that failed their check or could not run."""
    return [r for r in doc["rows"] if r["kernel"] in OURS and ("error" in r or "skipped" in r)]


def model_doc(device_name: str, shapes=SHAPES, ms=M_SWEEP) -> dict:
    """The roofline model as a results document (plots.py draws it like a measured one)."""
    spec = roofline.device(device_name)
    return {
        "kind": "roofline model (not measured)",
        "device": _device_dict(spec),
        "group_size": GROUP_SIZE,
        "rows": roofline.model_rows(spec, shapes, ms),
    }


def latest_measured(results_dir: Path = RESULTS_DIR) -> dict | None:
    """The newest recorded GPU run under results/ (None if there is none yet)."""
    docs = []
    for p in sorted(results_dir.glob("bench_*.json")):
        doc = json.loads(p.read_text())
        if doc.get("kind") == "measured":
            docs.append((doc["environment"]["date_utc"], doc))
    return max(docs, key=lambda d: d[0])[1] if docs else None


def summary_lines(doc: dict, kernels=None) -> list[str]:
    """The table a reader looks at first: time, model, % of bound, speedups."""
    label = "MEASURED" if doc["kind"] == "measured" else doc["kind"].upper()
    lines = [f"{label}, device: {doc['device']['name'] if doc['device'] else '?'}",
             f"{'shape':<20}{'M':>5} {'kernel':<21}{'time us':>9}{'model us':>9}{'% bound':>8}"
             f"{'x bf16':>7}{'x base':>7}"]  # fmt: skip
    for r in doc["rows"]:
        if kernels and r["kernel"] not in kernels:
            continue
        t = r.get("time_s")
        status = "FAILED" if "error" in r else "skipped" if "skipped" in r else "checked"
        cells = [f"{t * 1e6:.1f}" if t else status, _fmt(r, "expected_s", "{:.1f}", 1e6),
                 _fmt(r, "pct_of_bound", "{:.0f}"), _fmt(r, "speedup_vs_bf16", "{:.2f}"),
                 _fmt(r, "speedup_vs_baseline", "{:.2f}")]  # fmt: skip
        lines.append(f"{r['shape']:<20}{r['M']:>5} {r['kernel']:<21}{cells[0]:>9}{cells[1]:>9}"
                     f"{cells[2]:>8}{cells[3]:>7}{cells[4]:>7}")  # fmt: skip
    return lines


def _native() -> bool:
    """Kernels run natively on a GPU (else: the interpreter; checked, not timed)."""
    return _backend.HAS_CUDA and not _backend.INTERPRET


def _fmt(row: dict, key: str, spec: str, scale: float = 1.0) -> str:
    return spec.format(row[key] * scale) if row.get(key) else "-"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def save_plots(doc: dict, out_dir: Path, stem: str) -> list[Path]:
    paths = [out_dir / f"{stem}_roofline.png", out_dir / f"{stem}_speedup.png"]
    plots.plot_roofline(doc, paths[0])
    plots.plot_speedup(doc, paths[1])
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qlab.kernels.bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(SHAPES_QUICK)} shapes, M in {M_QUICK}")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--device", default="H100 SXM", choices=sorted(qlab.cost.DEVICES),
                        help="datasheet GPU for the roofline model without a GPU")  # fmt: skip
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--rep-ms", type=int, default=50, help="timing budget per case")
    args = parser.parse_args(argv)

    if _native():
        shapes, ms = (SHAPES_QUICK, M_QUICK) if args.quick else (SHAPES, M_SWEEP)
        gpu = _slug(torch.cuda.get_device_name())
        stem = f"bench_{gpu}_{_dt.date.today().isoformat()}"
        doc = run(shapes, ms, args.out / f"{stem}.json", timed=True, rep_ms=args.rep_ms)
        print("\n".join(summary_lines(doc)))
        paths = [args.out / f"{stem}.json"]
        if not args.no_plots and doc["device"] is not None:
            paths += save_plots(doc, args.out, stem)
    else:
        print("No CUDA GPU: every candidate the CPU can run, on the Triton interpreter, checked")
        print("against qlab but NOT timed (interpreter timings are not performance), then the")
        print("roofline MODEL.")
        doc = run(SHAPES_CPU, M_CPU, args.out / "correctness_cpu.json", timed=False)
        print("\n".join(summary_lines(doc)))
        model = model_doc(args.device, SHAPES_QUICK if args.quick else SHAPES, M_SWEEP)
        stem = f"roofline_model_{_slug(args.device)}"
        _write(model, args.out / f"{stem}.json")
        paths = [args.out / "correctness_cpu.json", args.out / f"{stem}.json"]
        if not args.no_plots:
            paths += save_plots(model, args.out, stem)
        for label in dict.fromkeys(r["shape"] for r in model["rows"]):
            m_stop = roofline.stops_paying_m(model["rows"], label, "w4a16")
            print(f"   model, {label}: W4A16 gains under 10% over bf16 from M = {m_stop}")
    for p in paths:
        print("wrote", p)
    failed = failures(doc)
    if failed:
        print(f"FAILED: {len(failed)} checks of our kernels:", file=sys.stderr)
        for r in failed:
            print(f"  {r['shape']} M={r['M']} {r['kernel']}: {r.get('error', r.get('skipped'))}",
                  file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
