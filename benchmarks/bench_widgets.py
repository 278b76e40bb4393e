"""Milliseconds per widget update, on the default data (budget: 100 ms each).

    python benchmarks/bench_widgets.py [--repeat N] [--json PATH]

An update is what happens when a learner moves one control: the kernel-side
callback recomputes (qlab) and redraws (matplotlib Agg -> PNG) and sets the new
widget values. No browser is involved; the front end only swaps an image and a
text. For each control the script cycles through a few values and reports the
median and worst time; "cold" moves hit values never computed before (the
explorer caches quantizations, so the first visit to a granularity or an outlier
strength recomputes ~25 quantizations, later visits only redraw).
Prints one line per control; exit status 1 if a median exceeds the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

BUDGET_MS = 100.0


def _time_moves(widget_control, values, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        for v in values:
            t0 = time.perf_counter()
            widget_control.value = v
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)

    from qlab.widgets import DecodeCalculator, FormatExplorer, GranularityExplorer

    rows = []

    def record(name: str, times: list[float]) -> None:
        rows.append(
            {
                "update": name,
                "median_ms": statistics.median(times),
                "max_ms": max(times),
                "n": len(times),
            }
        )

    t0 = time.perf_counter()
    ex = GranularityExplorer()
    record("granularity explorer: construct (first draw, cold)", [(time.perf_counter() - t0) * 1e3])
    # cold: every outlier strength visited once, each one computes all the schemes afresh
    record("granularity explorer: outliers, cold", _time_moves(ex.outliers, [25.0, 30.0, 35.0], 1))
    record("granularity explorer: granularity, cold", _time_moves(ex.granularity, [64, 32, 16], 1))
    # warm: the values a learner goes back and forth between
    record("granularity explorer: bits", _time_moves(ex.bits, [3, 5, 4], args.repeat))
    record(
        "granularity explorer: granularity",
        _time_moves(ex.granularity, ["tensor", 128, 32], args.repeat),
    )
    record("granularity explorer: outliers", _time_moves(ex.outliers, [0.0, 20.0], args.repeat))
    record(
        "granularity explorer: scheme",
        _time_moves(ex.family, ["nf4", "nvfp4", "mxfp4", "int"], args.repeat),
    )

    fe = FormatExplorer()
    record("format explorer: value", _time_moves(fe.value, [0.3, 300.0, -1.7e-3], args.repeat))
    record(
        "format explorer: format",
        _time_moves(fe.format, ["fp8_e5m2", "fp4_e2m1fn", "nf4", "fp8_e4m3fn"], args.repeat),
    )

    dc = DecodeCalculator()
    record("decode calculator: weight bits", _time_moves(dc.weight_bits, [16, 8, 4], args.repeat))
    record("decode calculator: device", _time_moves(dc.device, ["B200", "H100 SXM"], args.repeat))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"widget updates, ms (budget {BUDGET_MS:.0f} ms; load average {load:.2f}):")
    width = max(len(r["update"]) for r in rows)
    over = False
    for r in rows:
        flag = ""
        if "construct" not in r["update"] and r["median_ms"] > BUDGET_MS:
            flag, over = "  OVER BUDGET", True
        print(
            f"  {r['update']:<{width}}  median {r['median_ms']:7.1f}  max {r['max_ms']:7.1f}"
            f"  (n={r['n']}){flag}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_ms": BUDGET_MS, "load_average": load, "updates": rows}, f, indent=1)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
