"""The roofline model (kernels/roofline.py): bytes and FLOPs by hand, bounds, the crossover."""

import pytest

import qlab
from qlab.kernels import roofline

H100 = qlab.cost.DEVICES["H100 SXM"]
SQUARE = (("square 8192x8192", 8192, 8192),)
M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def test_counts_by_hand():
    m, n, k = 1, 8192, 8192
    assert roofline.flops(m, n, k) == 2 * 8192 * 8192
    # x (16 KiB bf16) + W (128 MiB bf16) + y (16 KiB)
    assert roofline.bytes_moved("torch_bf16", m, n, k) == 16384 + 134217728 + 16384
    # packed int4 is half a byte per weight, plus one fp16 scale per 128 weights
    assert roofline.bytes_moved("w4a16", m, n, k) == 16384 + 33554432 + 1048576 + 16384
    # tinygemm keeps a bf16 scale AND a bf16 zero per group
    assert roofline.bytes_moved("tinygemm", m, n, k) == 16384 + 33554432 + 2097152 + 16384
    # dequantize-then-matmul writes the bf16 weight and reads it back
    assert roofline.bytes_moved("dequant_bf16", m, n, k) == (
        33554432 + 1048576 + 134217728 + 16384 + 134217728 + 16384
    )
    gemm = 8192 + 67108864 + 4 * (1 + 8192) + 16384
    assert roofline.bytes_moved("fp8_gemm", m, n, k) == gemm
    assert roofline.bytes_moved("torch_scaled_mm", m, n, k) == gemm
    # one fused pass: read x (bf16), write its fp8 codes and one fp32 scale
    assert roofline.bytes_moved("fp8", m, n, k) == gemm + 16384 + 8192 + 4
    with pytest.raises(ValueError, match="unknown kernel"):
        roofline.bytes_moved("int3", m, n, k)


def test_bound_says_which_roof_and_how_close():
    assert roofline.ridge_intensity(H100) == pytest.approx(295.34, abs=0.01)
    assert roofline.ridge_intensity("H100 SXM", "fp8") == pytest.approx(590.7, abs=0.1)
    decode = roofline.bound("w4a16", 1, 8192, 8192, H100)
    assert decode.kind == "memory"
    assert decode.seconds == pytest.approx(34635776 / 3.35e12, rel=1e-12)
    prefill = roofline.bound("torch_bf16", 4096, 8192, 8192, "H100 SXM", seconds=1e-3)
    assert prefill.kind == "compute"
    assert prefill.seconds == pytest.approx(2 * 4096 * 8192**2 / 989.4e12)
    assert prefill.percent == pytest.approx(100 * prefill.seconds / 1e-3)
    assert roofline.expected_seconds("w4a16", 1, 8192, 8192, H100) == decode.seconds
    with pytest.raises(KeyError, match="no datasheet figures"):
        roofline.device("H800")


def test_model_rows_and_where_4_bits_stop_paying():
    rows = roofline.model_rows(H100, SQUARE, M_SWEEP)
    by = {(r["kernel"], r["M"]): r for r in rows}
    # decode: 4-bit weights read 16 / 4.125 = 3.88x fewer bytes than bf16
    assert by[("w4a16", 1)]["speedup_vs_bf16"] == pytest.approx(3.876, abs=1e-3)
    assert by[("fp8", 1)]["speedup_vs_bf16"] == pytest.approx(2.0, abs=0.01)
    # compute-bound: weight-only gains nothing, fp8 tensor cores gain 2x
    assert by[("w4a16", 4096)]["speedup_vs_bf16"] == pytest.approx(1.0)
    assert by[("fp8", 4096)]["speedup_vs_bf16"] == pytest.approx(1978.9 / 989.4)
    assert by[("w4a16", 4096)]["bound"] == "compute" and by[("w4a16", 1)]["bound"] == "memory"
    assert roofline.stops_paying_m(rows, "square 8192x8192", "w4a16") == 512
    assert roofline.stops_paying_m(rows, "square 8192x8192", "fp8") is None
    a100 = roofline.model_rows("A100 80GB", SQUARE, (1,))
    assert {r["kernel"] for r in a100} == {"torch_bf16", "w4a16"}  # no fp8 on sm_80


def test_issue_roof_from_the_bf16_peak():
    # 132 SMs x 1.83 GHz x 128 thread-instructions per clock = 30.9e12 per second
    assert roofline.issue_rate(H100) == pytest.approx(132 * 1.83e9 * 128, rel=1e-3)
    assert roofline.issue_rate(H100) / H100.bandwidth_bytes_per_s == pytest.approx(9.23, abs=0.01)
    assert roofline.issue_rate("H200") / 4.8e12 == pytest.approx(6.44, abs=0.01)
    # 9.2 instructions per byte stream exactly at the H100's bandwidth; twice that, half
    nbytes = 8.65e6
    at_bw = roofline.issue_rate(H100) / H100.bandwidth_bytes_per_s
    assert roofline.issue_seconds(at_bw, nbytes, H100) == pytest.approx(nbytes / 3.35e12)
    assert roofline.issue_seconds(2 * at_bw, nbytes, H100) == pytest.approx(2 * nbytes / 3.35e12)
