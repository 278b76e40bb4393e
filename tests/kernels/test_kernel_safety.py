"""Safe at any size and any input: 64-bit row offsets where an offset passes 2**31 - 1, one
NaN/inf policy for FP8 activations, the FP8 GEMM's checks of its scales and of K, and
split-K counters that an aborted launch does not leave dirty (tests/kernels/conftest.py
checks them after every launch of every kernel test)."""

import subprocess
import sys

import pytest
import torch

import qlab
from qlab.kernels import (
    DEVICE,
    INTERPRET,
    FP8Weight,
    compile_for,
    configs,
    fp8,
    fp8_linear,
    fp8_scaled_mm,
    pack_fp8,
    quantize_act_fp8,
)
from qlab.kernels._backend import needs_int64

HUGE_STRIDE = 2**30 + 64  # row 2 starts 2**31 + 128 elements in: past int32

FAR_APART = f"""
import torch
from qlab.kernels import DEVICE, fp8_linear, pack_fp8, pack_w4a16, w4a16_linear
from qlab.kernels._backend import needs_int64


def far_apart(rows):  # the same values, rows {HUGE_STRIDE} elements apart (2 GB, untouched)
    n, k = rows.shape
    far = torch.empty({HUGE_STRIDE} * (n - 1) + k, dtype=rows.dtype, device=rows.device)
    view = far.as_strided((n, k), ({HUGE_STRIDE}, 1))
    view.copy_(rows)
    assert needs_int64(view)
    return view


torch.manual_seed(0)
weight = (torch.randn(3, 256) * 0.05).to(DEVICE)
x = torch.randn(2, 256).bfloat16().to(DEVICE)
w8 = pack_fp8(weight)
far8 = w8._replace(codes=far_apart(w8.codes.view(torch.uint8)).view(w8.codes.dtype))
w4 = pack_w4a16(weight.bfloat16(), 128)
w4 = w4._replace(words=None)  # the plain-layout GEMV, which reads packed
far4 = w4._replace(packed=far_apart(w4.packed))
for m in (1, 2):  # FP8 swap-AB with and without split-K; the W4A16 GEMV and GEMM
    print(torch.equal(fp8_linear(x[:m], far8), fp8_linear(x[:m], w8)),
          torch.equal(w4a16_linear(x[:m], far4), w4a16_linear(x[:m], w4)))
"""


def test_needs_int64_counts_the_largest_offset():
    def meta(shape, strides):  # a tensor without memory
        return torch.empty_strided(shape, strides, device="meta")

    assert not needs_int64(meta((2, 3), (3, 1)), meta((2**15, 2**16 - 1), (2**16 - 1, 1)))
    assert needs_int64(meta((2, 3), (3, 1)), meta((2**15, 2**16), (2**16, 1)))  # 2**31 elements
    assert needs_int64(meta((3, 4), (HUGE_STRIDE, 1)))  # few elements, far apart
    assert not needs_int64(meta((0, 4), (HUGE_STRIDE, 1)))  # empty: nothing is read


def test_rows_2_gb_apart_give_the_same_result():
    # The kernels' row offsets (row * stride) in int64 (INDEX_64), run on the interpreter,
    # whose numpy int32 arithmetic wraps as a GPU's would: there the last row would be read
    # 2 GB off (a crash, hence a fresh Python).
    result = subprocess.run([sys.executable, "-c", FAR_APART], capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True"] * 4


@pytest.mark.parametrize("kernel", ["w4a16", "fp8"])
def test_a_128k_vocabulary_lm_head_at_16k_tokens_builds_with_64_bit_offsets(kernel):
    # y (16384, 131072) has 2**31 elements: its offsets need 64 bits; 4096^2 needs none.
    big = compile_for(kernel, M=16384, N=131072, K=4096)
    small = compile_for(kernel, M=16384, N=4096, K=4096)
    assert big["meta"]["INDEX_64"] is True and small["meta"]["INDEX_64"] is False
    # row * stride: 32-bit products (mul.lo.s32, which wrap) become 64-bit ones
    for op, more in (("mul.lo.s32", False), ("mul.wide.s32", True)):
        assert (big["ptx"].count(op) > small["ptx"].count(op)) is more, op


# ----------------------------------------------------------------------------- NaN / inf
@pytest.mark.parametrize("k", [64, fp8.ONE_PASS_MAX_K + 16])  # one pass, two passes
def test_a_nan_or_inf_makes_its_row_nan_and_leaves_the_others(k):
    torch.manual_seed(1)
    x = torch.randn(4, k).bfloat16()
    x[0, 5], x[1, k - 1], x[2, 0] = float("nan"), float("inf"), -float("inf")
    codes, scales = quantize_act_fp8(x.to(DEVICE))
    codes, scales = codes.cpu().view(torch.uint8), scales.cpu()
    assert scales[:3].isnan().all() and bool(scales[3].isfinite())
    assert ((codes[:3] & 0x7F) == 0x7F).all()  # E4M3's NaN, every code of those rows
    with pytest.raises(ValueError, match="NaN/inf"):  # qlab has no answer for those rows
        qlab.quantize(x, "fp8_e4m3", "channel")
    clean = qlab.quantize(x[3:], "fp8_e4m3", "channel")  # and the kernel's row 3 is qlab's
    assert torch.equal(codes[3:], clean.codes) and torch.equal(scales[3:], clean.scales.flatten())
    _, scale = quantize_act_fp8(x.to(DEVICE), "tensor")  # one scale: NaN
    assert bool(scale.isnan())


def test_fp8_linear_gives_nan_rows_never_finite_numbers():
    torch.manual_seed(2)
    weight = (torch.randn(32, 64) * 0.05).to(DEVICE)
    x = torch.randn(3, 64).half()
    x[1, 7] = float("nan")
    y = fp8_linear(x.to(DEVICE), pack_fp8(weight)).cpu()
    assert y[1].isnan().all()
    clean = fp8_linear(x[[0, 2]].to(DEVICE), pack_fp8(weight)).cpu()
    assert torch.equal(y[[0, 2]], clean)
    y = fp8_linear(x.to(DEVICE), pack_fp8(weight), act_granularity="tensor").cpu()
    assert y.isnan().all()


# ----------------------------------------------------------------------------- FP8 checks
def test_fp8_scales_are_checked_for_dtype_and_shape():
    weight = torch.randn(32, 64).to(DEVICE)
    w8 = pack_fp8(weight)
    q_x, s_x = quantize_act_fp8(torch.randn(4, 64).half().to(DEVICE))
    with pytest.raises(TypeError, match="w.scales must be float32.*fp32 bits"):
        fp8_scaled_mm(q_x, s_x, w8._replace(scales=w8.scales.half()), torch.half)
    with pytest.raises(ValueError, match=r"shape \(32,\) for 'channel'.*got \(1,\)"):
        fp8_scaled_mm(q_x, s_x, w8._replace(scales=w8.scales[:1]), torch.half)
    with pytest.raises(ValueError, match=r"shape \(1,\) for 'tensor'"):
        fp8_scaled_mm(q_x, s_x, w8._replace(granularity="tensor"), torch.half)
    with pytest.raises(TypeError, match="s_x must be a float32 tensor"):
        fp8_scaled_mm(q_x, s_x.half(), w8, torch.half)
    with pytest.raises(ValueError, match="w.codes must be float8_e4m3fn"):
        fp8_linear(torch.randn(4, 64).half().to(DEVICE), FP8Weight(weight, w8.scales, "channel"))


def test_k_not_a_multiple_of_16_is_refused_with_the_padding_to_use():
    w8 = pack_fp8(torch.randn(8, 200).to(DEVICE))
    with pytest.raises(ValueError, match=r"K = 200 is not a multiple of 16.*to K = 208"):
        fp8_linear(torch.randn(2, 200).half().to(DEVICE), w8)


# ----------------------------------------------------------------------------- split-K
@pytest.mark.skipif(not INTERPRET, reason="stops the interpreter inside a launch")
def test_an_aborted_split_k_launch_leaves_the_counters_at_zero(monkeypatch, counters_at_zero):
    from triton.runtime import interpreter

    torch.manual_seed(3)
    w8 = pack_fp8((torch.randn(96, 1024) * 0.05).to(DEVICE))
    x = torch.randn(1, 1024).half().to(DEVICE)
    want = fp8_linear(x, w8)
    with configs.recording() as launched:
        fp8_linear(x, w8)
    assert launched[-1].grid[1] > 1  # split-K: programs count themselves in per tile
    real, calls = interpreter.InterpreterBuilder.create_atomic_rmw, []

    def interrupted(self, *args, **kwargs):  # the 2nd program to count in never does
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fp8_linear(x, w8)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", real)
    counters_at_zero("an aborted launch")  # the first program's count was undone
    assert torch.equal(fp8_linear(x, w8), want)
