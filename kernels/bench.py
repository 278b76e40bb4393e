"""Benchmark harness for the kernel labs: `python -m qlab.kernels.bench [--quick]`.

On a CUDA GPU, for every layer shape and batch size M, every candidate of
kernels/baselines.py (our W4A16 and FP8 kernels; torch bf16, tinygemm, dequantize-then-
bf16, torch._scaled_mm both accumulation modes, GEMM-only and end to end) is

  1. run once (compiling and autotuning) and CHECKED against qlab (kernels/tolerance.py);
     a wrong output is recorded and never timed;
  2. timed by ONE method for every row: CUDA events around single calls, each call after
     a sum over a FLUSH buffer of at least 512 MiB and at least 8x L2 (10x an H100's 50 MB)
     and a GPU spin of SPIN_CYCLES (about 1 ms) while the CPU queues the call. The sum only
     READS: L2 is left holding clean lines of that buffer, none of the call's weights, and
     no dirty line whose write-back would be charged to the timed kernel (do_bench's flush,
     zero_(), writes). Median of as many calls as fit in --rep-ms;
  3. put beside the roofline model's expected time for the matched datasheet device
     (kernels/roofline.py: a model, a lower bound), with the bound that applies and the
     percent of it achieved; speedups over bf16 and over the matching baseline.

Nothing that goes wrong ends the run. An exception while checking or timing marks its
row (error / skipped) and the next row runs. Each shape runs in its own Python process
(GPU runs): a CUDA fault, which poisons the process's context, ends only that shape; the
parent records it and starts the next shape. Every row is appended to a JSON-lines file
(results/bench_<GPU>_<date>.jsonl, first line: date, GPU name, versions, commit) the
moment it is done, and results/bench_<GPU>_<date>.json (rows grouped, with speedups and
the model) is rewritten after every shape, so a timeout or crash keeps what was measured.
Without a GPU the same loop runs every candidate the CPU can (the Triton interpreter) on
small shapes, checked, NOT timed (interpreter timings measure numpy), and the roofline
MODEL is written, labelled as such. `--plan` counts the work of a run (rows, autotuned
configs, Triton compilations) and, with `--aot`, compiles every kernel of it ahead of
time to measure the compilation (kernels/bench_budget.py).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import hashlib
import json
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
FLUSH_MIN_BYTES = 512 << 20  # read before every timed call: >= 8x an H100/H200's L2
# GPU clock cycles spun (torch.cuda._sleep) after the flush: about 1 ms at 2 GHz, time for
# the CPU to queue the whole call. With the flush alone (about 110 us at 4.8 TB/s), calls
# through Python wrappers (ours) took up to 5.1x the time on an H200 (2026-12-04) where
# neither code nor launch config changed (torch's eager FP8, launches not recorded, 5.9x),
# the cause not established (docs/KERNELS.md, "Measured on an H200").
SPIN_CYCLES = 2_000_000
MIN_REPS, MAX_REPS = 5, 200  # timed calls per row (as many as fit in rep_ms)
TIMING = (f"median of single calls, each after reading a >= {FLUSH_MIN_BYTES >> 20} MB buffer "
          f"(L2 cold and clean) and a {SPIN_CYCLES:,}-cycle GPU spin (the CPU queues the "
          "call meanwhile), CUDA events around the call")  # fmt: skip
CUDA_FAULT_EXIT = 3  # a shape process's exit code after a CUDA fault
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
def flush_buffer(l2_bytes: int | None) -> torch.Tensor:
    """The buffer read before every timed call: FLUSH_MIN_BYTES, or 8x L2 if larger."""
    n_bytes = max(FLUSH_MIN_BYTES, 8 * (l2_bytes or 0))
    return torch.ones(n_bytes // 4, dtype=torch.float32, device="cuda")


def time_cold(fn, flush: torch.Tensor, rep_ms: float) -> float:
    """Median seconds of fn() over single calls, each after flush.sum() (a read: the
    call's data is out of L2 and nothing dirty is left to write back) and a GPU spin of
    SPIN_CYCLES, timed by CUDA events around the call only. As many calls as fit in rep_ms
    (MIN_REPS..MAX_REPS). The CPU's launch stays out of the time as long as it queues all of
    fn's kernels before the GPU finishes the flush and the spin (about 1.1 ms); the GPU's
    own launch latency stays in."""

    def once(start, end):
        flush.sum()  # queued ahead of the call, with the spin: the GPU is busy while
        torch.cuda._sleep(SPIN_CYCLES)  # the CPU launches fn
        start.record()
        fn()
        end.record()

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(MAX_REPS)]  # fmt: skip
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for pair in events[:3]:  # estimate: flush + call, three times
        once(*pair)
    t1.record()
    torch.cuda.synchronize()
    reps = int(min(MAX_REPS, max(MIN_REPS, rep_ms / (t0.elapsed_time(t1) / 3))))
    for pair in events[:reps]:
        once(*pair)
    torch.cuda.synchronize()
    ms = sorted(start.elapsed_time(end) for start, end in events[:reps])
    return ms[len(ms) // 2] / 1e3


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:300]


class CudaFault(RuntimeError):
    """The CUDA context is broken: nothing more can run in this process."""


def cuda_alive() -> bool:
    """False when the CUDA context is broken (after an illegal address, a trap, ...):
    every later call would fail, so the shape's process must end."""
    if not _native():
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 (any failure here means a dead context)
        return False


# ----------------------------------------------------------------------------- one row
def measure(cand, ref, w, timer=None) -> dict:
    """Run, check and (with timer(fn) -> seconds) time one candidate on ref.x; the row's
    measurement fields. Any exception marks the row: "skipped" (could not run), "error"
    (wrong output, or the timing failed)."""
    try:
        args = cand.setup(ref.x, w)
        if timer is not None:
            cand.fn(*args)  # compile and autotune first: record one plain call below
        with configs.recording() as launched:
            y = cand.fn(*args)
        problem = cand.check(y, ref)
    except Exception as err:  # noqa: BLE001 (one row's failure never ends the run)
        return {"skipped": _describe(err)}
    row = {"launches": [lc.describe() for lc in launched]}
    if problem:
        return {**row, "error": problem}
    if timer is not None:
        try:
            row["time_s"] = timer(functools.partial(cand.fn, *args))
        except Exception as err:  # noqa: BLE001 (CUDA-graph capture, out of memory, ...)
            row["error"] = "timing failed: " + _describe(err)
    return row


def run_shape(label: str, n: int, k: int, ms, emit, timed: bool, rep_ms: float = 50,
              timer=None) -> None:  # fmt: skip
    """Every candidate at every M for one layer shape; emit(record) gets each row as soon as
    it is done. timed: on the GPU, with time_cold (timer= replaces it, e.g. in tests).
    Raises CudaFault when a row leaves the CUDA context broken (the row is emitted first)."""
    device = _backend.DEVICE
    native = _native()
    fp8_ok = not native or torch.cuda.get_device_capability() >= (8, 9)
    emit({"record": "shape", "shape": label, "clocks": gpu_clocks() if native else None})
    torch.manual_seed(0)
    weight = (torch.randn(n, k) * 0.02).to(device, torch.bfloat16)
    w = baselines.prepare(weight, GROUP_SIZE, fp8_ok)
    if timed and timer is None:
        flush = flush_buffer(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0))
        timer = functools.partial(time_cold, flush=flush, rep_ms=rep_ms)
    for m in ms:
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        ref = baselines.Reference(x, w)
        for cand in baselines.candidates(fp8_ok):
            row = {"record": "row", "shape": label, "N": n, "K": k, "M": m, "kernel": cand.name}
            row.update(measure(cand, ref, w, timer if timed else None))
            emit(row)
            if ("error" in row or "skipped" in row) and not cuda_alive():
                raise CudaFault(f"CUDA fault at {label} M={m} {cand.name}: the shape ends here")


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


# ----------------------------------------------------------------------------- the run
def _append(path: Path, record: dict) -> None:
    """One JSON line, on disk before the next row starts."""
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _child_command(spec: dict) -> list[str]:
    """The command that runs one shape in its own process (tests replace it)."""
    return [sys.executable, "-m", "qlab.kernels.bench", "--shape-process", json.dumps(spec)]


def _run_shape_process(spec: dict, jsonl: Path, timeout_s: float | None) -> None:
    """One shape in a child process; if it dies (CUDA fault, crash, timeout), say so in a
    record and go on."""
    try:
        child = subprocess.run(_child_command(spec), capture_output=True, text=True,
                               timeout=timeout_s)  # fmt: skip
        code, out, err = child.returncode, child.stdout, child.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = "timeout", exc.stdout or "", exc.stderr or ""
        out, err = (t.decode() if isinstance(t, bytes) else t for t in (out, err))
    sys.stdout.write(out)
    sys.stderr.write(err)
    if code != 0:
        _append(jsonl, {"record": "shape_failed", "shape": spec["label"], "exit_code": code,
                        "stderr_tail": err[-1500:]})  # fmt: skip


def assemble(records: list[dict]) -> dict:
    """JSON-lines records -> the results document: rows grouped per (shape, M) with the
    model, bound and speedup columns; shapes whose process died in shape_failures."""
    env = next(r for r in records if r["record"] == "environment")
    env = {k: v for k, v in env.items() if k not in ("record", "timed", "timing")}
    timed = records[0].get("timed", False)
    table = match_device(env.get("gpu")) if timed else None
    spec = qlab.cost.DEVICES[table] if table else None
    rows = _of_kind(records, "row")
    for key in dict.fromkeys((r["shape"], r["M"]) for r in rows):
        finish_rows([r for r in rows if (r["shape"], r["M"]) == key], spec)
    return {
        "kind": "measured" if timed else "correctness (CPU interpreter; not timed)",
        "environment": env,
        "device": _device_dict(spec) if spec else None,
        "group_size": GROUP_SIZE,
        "timing": records[0].get("timing"),
        "rows": rows,
        "clocks_per_shape": _of_kind(records, "shape"),
        "shape_failures": _of_kind(records, "shape_failed"),
    }


def _of_kind(records: list[dict], kind: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "record"} for r in records if r["record"] == kind]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(shapes, ms, out_path: Path | None, timed: bool, rep_ms: float = 50,
        isolate: bool = False, shape_timeout_s: float | None = None) -> dict:  # fmt: skip
    """The sweep: every candidate on every shape and M. Rows go to out_path's .jsonl as
    they finish; the document (returned) is rewritten to out_path after every shape.
    isolate: each shape in its own process (what the GPU run does; see the docstring)."""
    header = {"record": "environment", "timed": timed, "timing": TIMING if timed else None,
              **environment()}  # fmt: skip
    if out_path is None and not isolate:
        records = [header]
        for label, n, k in shapes:
            run_shape(label, n, k, ms, records.append, timed, rep_ms)
        return assemble(records)
    if out_path is None:  # isolated shapes need a file to report into
        import tempfile

        out_path = Path(tempfile.mkdtemp(prefix="qlab_bench_")) / "bench.json"
    jsonl = out_path.with_suffix(".jsonl")
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("")
    _append(jsonl, header)
    for label, n, k in shapes:
        if isolate:
            spec = dict(label=label, n=n, k=k, ms=list(ms), timed=timed, rep_ms=rep_ms,
                        jsonl=str(jsonl))  # fmt: skip
            _run_shape_process(spec, jsonl, shape_timeout_s)
        else:
            run_shape(label, n, k, ms, functools.partial(_append, jsonl), timed, rep_ms)
        doc = assemble(_read_jsonl(jsonl))
        _write(doc, out_path)
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
    """Rows of OUR kernels that failed their check or could not run, and shapes whose
    process died (their rows after the fault are missing)."""
    rows = [r for r in doc["rows"] if r["kernel"] in OURS and ("error" in r or "skipped" in r)]
    died = [{"shape": f["shape"], "M": "-", "kernel": "(shape process)",
             "error": f"exit code {f['exit_code']}: {f['stderr_tail'][-300:]}"}
            for f in doc.get("shape_failures", ())]  # fmt: skip
    return rows + died


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
    for f in doc.get("shape_failures", ()):
        lines.append(f"{f['shape']:<20}  shape process died (exit code {f['exit_code']}): "
                     "its later rows are missing")  # fmt: skip
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
    parser.add_argument("--rep-ms", type=int, default=50, help="timing budget per row")
    parser.add_argument("--shape-timeout", type=float, default=None,
                        help="seconds one shape's process may run (GPU runs)")  # fmt: skip
    parser.add_argument("--plan", action="store_true",
                        help="count the GPU run's work (rows, autotuning, compilations); "
                             "no kernel runs")  # fmt: skip
    parser.add_argument("--aot", action="store_true",
                        help="with --plan: compile every kernel of the run ahead of time "
                             "and measure the compilation")  # fmt: skip
    parser.add_argument("--shape-process", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.shape_process:  # a child of run(isolate=True): one shape, rows to the JSONL
        spec = json.loads(args.shape_process)
        emit = functools.partial(_append, Path(spec["jsonl"]))
        try:
            run_shape(spec["label"], spec["n"], spec["k"], spec["ms"], emit, spec["timed"],
                      spec["rep_ms"])  # fmt: skip
        except CudaFault as fault:
            print(fault, file=sys.stderr)
            os._exit(CUDA_FAULT_EXIT)  # a broken context cannot even tear down cleanly
        return 0
    shapes, ms = (SHAPES_QUICK, M_QUICK) if args.quick else (SHAPES, M_SWEEP)
    if args.plan:
        from qlab.kernels import bench_budget

        print("\n".join(bench_budget.report(shapes, ms, args.rep_ms, aot=args.aot)))
        return 0
    if _native():
        gpu = _slug(torch.cuda.get_device_name())
        stem = f"bench_{gpu}_{_dt.date.today().isoformat()}"
        doc = run(shapes, ms, args.out / f"{stem}.json", timed=True, rep_ms=args.rep_ms,
                  isolate=True, shape_timeout_s=args.shape_timeout)  # fmt: skip
        print("\n".join(summary_lines(doc)))
        paths = [args.out / f"{stem}.json", args.out / f"{stem}.jsonl"]
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
