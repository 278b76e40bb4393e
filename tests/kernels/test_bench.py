"""The benchmark harness without a GPU: the CPU mode end to end (every candidate the CPU can
run, checked on the interpreter), device matching, the timing policy with stand-in timers,
the result columns, recorded-results loading and the plots."""

import itertools
import json

import pytest
import torch

import qlab
from qlab.kernels import baselines, bench, plots


def test_cpu_mode_checks_every_candidate_and_writes_a_labelled_model(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    monkeypatch.setattr(bench, "_native", lambda: False)  # on a GPU machine too: no timing
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NOT timed" in out and "MODEL" in out
    checked = json.loads((tmp_path / "correctness_cpu.json").read_text())
    names = {c.name for c in baselines.candidates(fp8=True)}
    assert {r["kernel"] for r in checked["rows"]} == names  # tinygemm and _scaled_mm included
    assert {r["M"] for r in checked["rows"]} == set(bench.M_CPU)
    assert all("error" not in r and "skipped" not in r for r in checked["rows"]), [
        r for r in checked["rows"] if "error" in r or "skipped" in r
    ]
    assert all("time_s" not in r for r in checked["rows"])  # interpreter: never timed
    ours = [r for r in checked["rows"] if r["kernel"] == "w4a16"]
    assert [r["launches"][-1]["kernel"] for r in ours] == [
        "_w4a16_gemv_mma_kernel", "_w4a16_gemm_kernel", "_w4a16_gemm_kernel"
    ]
    model = json.loads((tmp_path / "roofline_model_H100-SXM.json").read_text())
    assert model["kind"] == "roofline model (not measured)"
    assert len(model["rows"]) == len(bench.SHAPES_QUICK) * len(bench.M_SWEEP) * 3
    for suffix in ("roofline", "speedup"):
        png = tmp_path / f"roofline_model_H100-SXM_{suffix}.png"
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_wrong_kernel_fails_the_run(tmp_path, monkeypatch):
    real = baselines.w4a16_linear
    monkeypatch.setattr(baselines, "w4a16_linear", lambda x, w: real(x, w) * 1.01)
    monkeypatch.setattr(bench, "M_CPU", (1,))
    monkeypatch.setattr(bench, "_native", lambda: False)
    assert bench.main(["--quick", "--out", str(tmp_path), "--no-plots"]) == 1
    doc = json.loads((tmp_path / "correctness_cpu.json").read_text())
    assert [r["kernel"] for r in bench.failures(doc)] == ["w4a16"]


def test_match_device():
    assert bench.match_device("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert bench.match_device("NVIDIA H200") == "H200"
    assert bench.match_device("NVIDIA A100-SXM4-80GB") == "A100 80GB"
    assert bench.match_device("NVIDIA H100 PCIe") is None  # other bandwidth: no guess
    assert bench.match_device(None) is None
    assert bench.match_device("NVIDIA L4") == "L4"
    assert bench.match_device("NVIDIA L40S") == "L40S"
    # NVL boards and Grace Hopper have their own bandwidth and clocks: never H100 SXM/H200
    for name, key in (("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA GH200 480GB", "GH200"),
                      ("NVIDIA GH200 144G HBM3e", "GH200 144GB"),
                      ("NVIDIA H200 NVL", "H200 NVL")):  # fmt: skip
        assert bench.match_device(name) == key and key in qlab.cost.DEVICES


def test_timing_reads_the_flush_buffer_before_every_call_and_times_the_call_only(monkeypatch):
    seen = []

    class Event:  # a stand-in CUDA event: 2 ms between any start and end
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            seen.append("record")

        def elapsed_time(self, end):
            return 2.0

    class Flush:  # only a read is allowed: any write (zero_, fill_, copy_) would fail
        def sum(self):
            seen.append("read flush")

    monkeypatch.setattr(bench.torch.cuda, "Event", Event)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: seen.append("sync"))
    monkeypatch.setattr(bench.torch.cuda, "_sleep", lambda cycles: seen.append(cycles))
    t = bench.time_cold(lambda: seen.append("call"), Flush(), rep_ms=20)
    assert t == 2e-3
    spin = bench.SPIN_CYCLES  # time for the CPU to queue the call behind it
    one = ["read flush", spin, "record", "call", "record"]  # events around the call alone
    # estimate: 3 flush + spin + call rounds took 2 ms, so 20 ms holds 30 timed calls
    assert seen == ["record"] + one * 3 + ["record", "sync"] + one * 30 + ["sync"]
    assert bench.FLUSH_MIN_BYTES >= 256 << 20 and "after reading" in bench.TIMING
    assert spin >= 1_000_000 and "spin" in bench.TIMING  # >= 0.5 ms at 2 GHz


def test_rows_get_model_bound_and_like_for_like_speedups():
    spec = qlab.cost.DEVICES["H100 SXM"]
    shape = {"shape": "s", "N": 4096, "K": 4096, "M": 1}
    times = {"torch_bf16": 20e-6, "w4a16": 5e-6, "tinygemm": 10e-6, "fp8_gemm": 8e-6,
             "torch_scaled_mm": 6e-6, "fp8": 9e-6}  # fmt: skip
    rows = [{**shape, "kernel": k, "time_s": t} for k, t in times.items()]
    rows.append({**shape, "kernel": "torch_fp8_fast", "error": "wrong"})
    bench.finish_rows(rows, spec)
    by = {r["kernel"]: r for r in rows}
    assert by["w4a16"]["speedup_vs_bf16"] == pytest.approx(4.0)
    assert by["w4a16"]["baseline"] == "tinygemm" and by["w4a16"]["speedup_vs_baseline"] == 2.0
    assert by["fp8_gemm"]["baseline"] == "torch_scaled_mm"
    assert by["fp8_gemm"]["speedup_vs_baseline"] == pytest.approx(0.75)
    assert "speedup_vs_baseline" not in by["fp8"]  # torch_fp8 was not measured
    expected = 4096 * 4096 * (0.5 + 2 / 128) / 3.35e12  # weight bytes dominate
    assert by["w4a16"]["expected_s"] == pytest.approx(expected, rel=0.01)
    assert by["w4a16"]["bound"] == "memory"
    assert by["w4a16"]["pct_of_bound"] == pytest.approx(100 * by["w4a16"]["expected_s"] / 5e-6)
    assert "time_s" not in by["torch_fp8_fast"] and "expected_s" in by["torch_fp8_fast"]
    assert bench.failures({"rows": rows}) == []  # a broken baseline is not our failure


def test_tinygemm_puts_the_even_k_in_the_high_nibble():
    codes = torch.tensor([[1, -2, 7, -8]], dtype=torch.int8)  # uint4 = code + 8: 9 6 15 0
    assert baselines.tinygemm_bytes(codes).tolist() == [[0x96, 0xF0]]
    assert qlab.pack_int4(codes).tolist() == [[0xE1, 0x87]]  # qlab: even k low, two's complement


def _fake_measured(date: str, gpu: str) -> dict:
    doc = bench.model_doc("H200", bench.SHAPES[:1], (1, 4096))
    doc.update(kind="measured", environment={"date_utc": date, "gpu": gpu})
    return doc


def test_latest_measured_and_measured_plots(tmp_path):
    assert bench.latest_measured(tmp_path) is None
    (tmp_path / "bench_model.json").write_text(json.dumps(bench.model_doc("H200")))
    assert bench.latest_measured(tmp_path) is None  # a model is not a measurement
    for date in ("2026-01-02T00:00:00+00:00", "2026-03-04T00:00:00+00:00"):
        doc = _fake_measured(date, "NVIDIA H200")
        (tmp_path / f"bench_NVIDIA-H200_{date[:10]}.json").write_text(json.dumps(doc))
    latest = bench.latest_measured(tmp_path)
    assert latest["environment"]["date_utc"].startswith("2026-03-04")
    assert plots.plot_roofline(latest).axes[0].get_title().startswith("Measured on NVIDIA H200")
    fig = plots.plot_speedup(bench.model_doc("H100 SXM", bench.SHAPES[:2], (1, 16)))
    assert "MODEL" in fig.axes[0].get_title()
    lines = bench.summary_lines(latest)
    assert lines[0].startswith("MEASURED") and len(lines) == 2 + len(latest["rows"])


def test_plan_counts_rows_autotuning_keys_and_every_config_it_compiles():
    from qlab.kernels import bench_budget, configs

    w = bench_budget.work(bench.SHAPES_QUICK, bench.M_QUICK)
    n_candidates = len(baselines.candidates(fp8=True))
    assert w["rows"] == len(bench.SHAPES_QUICK) * len(bench.M_QUICK) * n_candidates
    # one key per shape and M bucket-and-power-of-two for W4A16, two (accumulation modes) for FP8
    assert w["autotune_keys"] == len(bench.SHAPES_QUICK) * len(bench.M_QUICK) * 3
    for (_, n, k), m, (kernel, modes) in itertools.product(
        bench.SHAPES_QUICK, bench.M_QUICK, (("w4a16", 1), ("fp8", 2))
    ):  # every config of the bucket is compiled (autotuning), FP8 in both accumulation modes
        built = [r["config"] for r in w["requests"] if (r["kernel"], r["M"], r["N"], r["K"])
                 == (kernel, m, n, k)]  # fmt: skip
        assert built == list(configs.configs_for(kernel, m)) * modes
