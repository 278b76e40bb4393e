"""What a GPU benchmark run costs, counted and partly measured on any CPU.

    python -m qlab.kernels.bench --quick --plan [--aot]

Counted: the rows (shape x M x candidate), the autotuning keys and the configs each times
(kernels/configs.py `choose`), and every Triton launch the run compiles: for each (shape,
M) every config of the bucket's list (autotuning compiles them all), FP8 in both
accumulation modes with its activation quantizer, and the dequantize kernel of the
dequant_bf16 baseline. With aot=True they are all built for sm_90 by compile_for in a
fresh Triton cache, which measures the CPU seconds of compilation (Triton's front end,
LLVM, ptxas) and counts the DISTINCT binaries by their PTX: a GPU run compiles each of
those once, the rest are cache hits (same specialization, same binary).

Also measured: a fresh Python's imports (each shape's process pays them) and the CPU
seconds of qlab quantizing the weights (baselines.prepare, on the smallest shape, scaled
by weight elements). Not measured here (no GPU): the timing itself, which --rep-ms bounds
per row, and the autotuning's do_bench calls (about AUTOTUNE_S_PER_CONFIG each).
report() adds them up.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

import triton

from qlab.kernels import aot, baselines, configs

__all__ = ["work", "report"]

COMPILE_TIMEOUT_S = 3600  # one build process compiles them all; a busy CPU is slow
AUTOTUNE_S_PER_CONFIG = 0.05  # do_bench(warmup=5 ms, rep=20 ms) plus its estimate and flushes


def work(shapes, ms) -> dict:
    """rows, autotune keys, configs timed by autotuning, and compile_for requests."""
    requests, keys, timed = [], set(), 0
    for _, n, k in shapes:
        requests.append(dict(kernel="dequant", M=1, N=n, K=k))  # dequant_bf16: M-independent
        for m in ms:
            for kernel, modes in (("w4a16", (None,)), ("fp8", (False, True))):
                listed = configs.configs_for(kernel, m)
                for fast in modes:
                    key = (kernel, configs.m_bucket(m), triton.next_power_of_2(m), n, k, fast)
                    if key not in keys and len(listed) > 1:
                        timed += len(listed)
                    keys.add(key)
                    opts = {} if fast is None else {"fast_accum": fast}
                    requests += [dict(kernel=kernel, M=m, N=n, K=k, config=c, **opts)
                                 for c in listed]  # fmt: skip
    rows = len(shapes) * len(ms) * len(baselines.candidates(fp8=True))
    return {"rows": rows, "autotune_keys": len(keys), "configs_timed": timed,
            "requests": requests}  # fmt: skip


def compile_all(requests: list[dict]) -> dict:
    """Build every request for sm_90 in a fresh Triton cache (one worker process); the CPU
    seconds of the build processes and the number of distinct binaries (by PTX)."""
    aot.close_build_processes()  # kept ones would add their CPU time to RUSAGE_CHILDREN
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qlab_triton_cache_") as cache:
        old = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            built = aot.compile_many(requests, timeout=COMPILE_TIMEOUT_S, workers=1, keep=False)
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    launches = [launch for b in built for launch in b["launches"]]
    return {
        "launches": len(launches),
        "distinct": len({launch["ptx"] for launch in launches}),
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "wall_s": time.perf_counter() - start,
    }


def _import_seconds() -> float:
    """Wall seconds of a fresh Python importing torch, triton and qlab.kernels (what every
    shape's process pays first)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import qlab.kernels.bench"], check=True,
                   env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True)  # fmt: skip
    return time.perf_counter() - start


def _prepare_cpu_seconds(shapes) -> float:
    """CPU seconds of baselines.prepare (qlab quantizes every weight on the CPU) for all the
    shapes: measured on the smallest, scaled by weight elements."""
    import torch

    _, n, k = min(shapes, key=lambda s: s[1] * s[2])
    weight = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    start = time.process_time()
    baselines.prepare(weight, 128, fp8=True)
    return (time.process_time() - start) * sum(s[1] * s[2] for s in shapes) / (n * k)


def report(shapes, ms, rep_ms: float, aot: bool = False) -> list[str]:
    """The work of a run and its time budget, as lines to print."""
    w = work(shapes, ms)
    lines = [
        f"{len(shapes)} shapes x {len(ms)} M = {w['rows']} rows (each checked, then timed "
        f"for about {rep_ms} ms)",
        f"{w['autotune_keys']} autotuning keys, {w['configs_timed']} configs timed by "
        f"autotuning; {len(w['requests'])} compile requests",
    ]
    start_s = _import_seconds()
    lines.append(f"one shape process starts in {start_s:.1f} s here (imports)")
    budget = {
        "timing rows": w["rows"] * rep_ms / 1e3,
        "autotuning": w["configs_timed"] * AUTOTUNE_S_PER_CONFIG,
        "process starts": len(shapes) * start_s,
        "weight prep": _prepare_cpu_seconds(shapes),
    }
    if aot:
        c = compile_all(w["requests"])
        lines.append(
            f"compiled {c['launches']} launches for sm_90: {c['distinct']} distinct "
            f"binaries, {c['cpu_s']:.0f} CPU s ({c['wall_s']:.0f} s wall) here"
        )
        budget["compilation"] = c["cpu_s"]
    lines += [f"  {name:<15}{seconds:8.1f} s" for name, seconds in budget.items()]
    lines.append(f"  {'total':<15}{sum(budget.values()):8.1f} s (plus the checks' fp32 "
                 "reference products on the GPU)")  # fmt: skip
    return lines
