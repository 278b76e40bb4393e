"""The benchmark harness without a GPU: byte/FLOP counting, the roofline model, the
CPU mode of `python -m qlab.kernels.bench`, plots and recorded-results loading."""

import json

import pytest

from qlab.kernels import bench


def test_counts_by_hand():
    m, n, k = 1, 8192, 8192
    assert bench.count_flops(m, n, k) == 2 * 8192 * 8192
    # x (16 KiB bf16) + W (128 MiB bf16) + y (16 KiB)
    assert bench.count_bytes("torch_bf16", m, n, k) == 16384 + 134217728 + 16384
    # packed int4 is half a byte per weight, plus one fp16 scale per 128 weights
    assert bench.count_bytes("w4a16", m, n, k) == 16384 + 33554432 + 1048576 + 16384
    gemm = 8192 + 67108864 + 4 * (1 + 8192) + 16384
    assert bench.count_bytes("fp8_gemm", m, n, k) == gemm
    assert bench.count_bytes("fp8", m, n, k) == gemm + (16384 + 4) + (16384 + 4 + 8192)
    with pytest.raises(ValueError, match="unknown kernel"):
        bench.count_bytes("int3", m, n, k)


def test_roofline_model_figures():
    spec = bench.device_spec("H100 SXM")
    assert spec["bandwidth_bytes_per_s"] == 3.35e12  # from qlab.cost.DEVICES
    assert bench.ridge_intensity(spec) == pytest.approx(295.34, abs=0.01)
    # M = 1 is bandwidth-bound: time = bytes / bandwidth
    t = bench.roofline_seconds("w4a16", 1, 8192, 8192, spec)
    assert t == pytest.approx(34635776 / 3.35e12, rel=1e-12)
    doc = bench.roofline_model("H100 SXM", bench.SHAPES[:1], bench.M_SWEEP)
    rows = {(r["kernel"], r["M"]): r for r in doc["rows"]}
    # decode: 4-bit weights read ~3.9x fewer bytes than bf16
    assert rows[("w4a16", 1)]["speedup_vs_bf16"] == pytest.approx(3.876, abs=1e-3)
    assert rows[("fp8", 1)]["speedup_vs_bf16"] == pytest.approx(2.0, abs=0.01)
    # compute-bound: weight-only gains nothing, fp8 tensor cores gain 2x
    assert rows[("w4a16", 4096)]["speedup_vs_bf16"] == pytest.approx(1.0)
    assert rows[("fp8", 4096)]["speedup_vs_bf16"] == pytest.approx(1978.9 / 989.4)
    assert bench.stops_paying_m(doc["rows"], "square 8192x8192", "w4a16") == 512
    assert bench.stops_paying_m(doc["rows"], "square 8192x8192", "fp8") is None
    a100 = bench.roofline_model("A100 80GB", bench.SHAPES[:1], (1,))
    assert {r["kernel"] for r in a100["rows"]} == {"torch_bf16", "w4a16"}  # no fp8 on sm_80


def test_match_device():
    assert bench.match_device("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert bench.match_device("NVIDIA H200") == "H200"
    assert bench.match_device("NVIDIA A100-SXM4-80GB") == "A100 80GB"
    assert bench.match_device("NVIDIA H100 PCIe") is None  # other bandwidth: no guess


def test_cpu_mode_writes_labelled_model_and_plots(tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not performance" in out and "MODEL" in out
    doc = json.loads((tmp_path / "roofline_model_H100-SXM.json").read_text())
    assert doc["kind"] == "roofline model (not measured)"
    assert all(c.get("ok", c.get("bit_exact")) for c in doc["correctness"])
    assert len(doc["rows"]) == 3 * len(bench.M_QUICK) * 3
    for suffix in ("roofline", "speedup"):
        png = tmp_path / f"roofline_model_H100-SXM_{suffix}.png"
        assert png.read_bytes()[:4] == b"\x89PNG"


def _fake_measured(date: str, gpu: str) -> dict:
    doc = bench.roofline_model("H200", bench.SHAPES[:1], (1, 4096))
    doc.update(kind="measured", environment={"date_utc": date, "gpu": gpu})
    return doc


def test_latest_measured_and_measured_plots(tmp_path):
    assert bench.latest_measured(tmp_path) is None
    (tmp_path / "roofline_model_H200.json").write_text(json.dumps(bench.roofline_model("H200")))
    assert bench.latest_measured(tmp_path) is None  # a model is not a measurement
    for date in ("2026-01-02T00:00:00+00:00", "2026-03-04T00:00:00+00:00"):
        doc = _fake_measured(date, "NVIDIA H200")
        (tmp_path / f"bench_NVIDIA-H200_{date[:10]}.json").write_text(json.dumps(doc))
    latest = bench.latest_measured(tmp_path)
    assert latest["environment"]["date_utc"].startswith("2026-03-04")
    fig = bench.plot_roofline(latest)
    assert fig.axes[0].get_title().startswith("Measured")
    fig = bench.plot_speedup(bench.roofline_model("H100 SXM", bench.SHAPES[:2], (1, 16)))
    assert "MODEL" in fig.axes[0].get_title()
    assert "ROOFLINE MODEL" in bench.summary_lines(bench.roofline_model("B200", (), ()))[0]
