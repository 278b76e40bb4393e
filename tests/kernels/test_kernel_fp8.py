"""FP8 W8A8 kernels against qlab: activation codes and scales bit-exact, the GEMM within
a bound derived from its arithmetic (see assert_within_bound)."""

import pytest
import torch
import triton
import triton.language as tl

import qlab
from qlab.kernels import (
    DEVICE,
    INTERPRET,
    FP8Weight,
    fp8_linear,
    fp8_scaled_mm,
    pack_fp8,
    quantize_act_fp8,
)
from qlab.kernels.fp8 import round_to_e4m3
from qlab.pipelines import w8a8_reference

E4M3 = qlab.formats.get("fp8_e4m3fn")
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_to_e4m3(x), mask=offs < n)


def test_round_to_e4m3_every_value_every_tie():
    # Every finite E4M3 value, every midpoint between neighbours (ties go to the even
    # code), a point just either side of each midpoint, and values past 448.
    v = E4M3.values.double()
    mids = (v[1:] + v[:-1]) / 2  # exact in fp32
    nudge = mids.abs() * 2.0**-20 + 2.0**-30
    x = torch.cat([v, mids, mids - nudge, mids + nudge, torch.tensor([464.0, 1e4, -1e30])])
    x = torch.cat([x, torch.tensor([-0.0, 2.0**-12, -(2.0**-11)])]).float()
    y = torch.empty_like(x, device=DEVICE)
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x.to(DEVICE), y, x.numel(), BLOCK=256)
    want = E4M3.decode(E4M3.encode(x))  # qlab: RNE, saturating, keeps -0.0
    assert torch.equal(y.cpu().view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("granularity", ["token", "tensor"])
def test_act_quant_bit_exact(dtype, granularity):
    torch.manual_seed(1)
    x = (torch.randn(37, 200) * torch.logspace(-3, 2, 37)[:, None]).to(dtype)
    x[3] = 0.0  # an all-zero token
    x[5, :7] = torch.tensor([1e-6, -1e-6, -0.0, 0.0, 3.0, -3.0, 1e-4])  # underflow to +-0
    codes, scales = quantize_act_fp8(x.to(DEVICE), granularity)
    qt = qlab.quantize(x, "fp8_e4m3", "channel" if granularity == "token" else "tensor")
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.cpu().view(torch.uint8), qt.codes)
    assert torch.equal(scales.cpu(), qt.scales.reshape(scales.shape))
    assert scales.shape == ((37,) if granularity == "token" else ())


def assert_within_bound(y, x, weight, w_gran, a_gran):
    """Both sides form the same exact fp8 x fp8 products and sum them in fp32 in
    different orders (<= K * 2**-23 of sum |products| apart); then y is rounded to x's
    dtype (one ulp, see test_kernel_w4a16.py). On a Hopper GPU tl.dot accumulates fp8
    with reduced precision (Triton's max_num_imprecise_acc), so there the sum term is
    2**-9 instead."""
    ref = w8a8_reference(x, weight, "fp8_e4m3", w_gran, a_gran)
    qx = qlab.quantize(x, "fp8_e4m3", "channel" if a_gran == "token" else "tensor")
    qw = qlab.quantize(weight, "fp8_e4m3", w_gran)
    magnitude = qlab.dequantize(qx).abs() @ qlab.dequantize(qw).abs().T
    k = x.shape[1]
    acc_rel = k * 2.0**-23 if INTERPRET else max(k * 2.0**-23, 2.0**-9)
    bound = acc_rel * magnitude + ULP[x.dtype] * ref.abs() + 2.0**-24
    err = (y.float().cpu() - ref).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"element {worst}: got {y.float().flatten()[worst].item()}, "
        f"expected {ref.flatten()[worst].item()} (bound {bound.flatten()[worst].item():.3g})"
    )


SHAPES = [  # (M, N, K)
    (1, 64, 128),
    (5, 72, 200),  # ragged K: not a multiple of BLOCK_K = 128
    (33, 130, 256),
    (130, 40, 128),
]


@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize(
    "dtype, w_gran, a_gran",
    [
        (torch.float16, "channel", "token"),
        (torch.bfloat16, "channel", "token"),
        (torch.float16, "tensor", "tensor"),
        (torch.bfloat16, "channel", "tensor"),
        (torch.float16, "tensor", "token"),
    ],
)
def test_matches_reference(m, n, k, dtype, w_gran, a_gran):
    torch.manual_seed(m + n + k)
    weight = (torch.randn(n, k) * 0.05).to(dtype)
    x = torch.randn(m, k).to(dtype)
    x[0, 0] = 20.0  # an activation outlier: per-token scales isolate it
    packed = pack_fp8(weight.to(DEVICE), w_gran)
    y = fp8_linear(x.to(DEVICE), packed, a_gran)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_within_bound(y, x, weight, w_gran, a_gran)


def test_packing_is_qlabs():
    weight = torch.randn(24, 64)
    for gran, n_scales in (("channel", 24), ("tensor", 1)):
        packed = pack_fp8(weight, gran)
        qt = qlab.quantize(weight, "fp8_e4m3", gran)
        assert isinstance(packed, FP8Weight) and packed.shape == (24, 64)
        assert torch.equal(packed.codes.cpu().view(torch.uint8), qt.codes)
        assert packed.scales.shape == (n_scales,)
        assert torch.equal(packed.scales.cpu(), qt.scales.reshape(-1))


def test_bound_catches_a_missing_activation_scale():
    torch.manual_seed(0)
    weight, x = torch.randn(32, 128) * 0.05, torch.randn(3, 128).half() * 30
    packed = pack_fp8(weight.to(DEVICE))
    y = fp8_linear(x.to(DEVICE), packed)
    assert_within_bound(y, x, weight, "channel", "token")
    _, s_x = quantize_act_fp8(x.to(DEVICE))
    with pytest.raises(AssertionError, match="element"):
        assert_within_bound(y.cpu() / s_x.cpu()[:, None].half(), x, weight, "channel", "token")


def test_bad_inputs_raise_clear_errors():
    weight = torch.randn(32, 64)
    packed = pack_fp8(weight.to(DEVICE))
    with pytest.raises(ValueError, match="'channel' or 'tensor'"):
        pack_fp8(weight, 32)
    with pytest.raises(ValueError, match="2-D"):
        pack_fp8(torch.randn(2, 3, 4))
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        fp8_linear(x, packed)
    with pytest.raises(ValueError, match="'token' or 'tensor'"):
        fp8_linear(x.half(), packed, act_granularity="channel")
    with pytest.raises(ValueError, match="in_features K = 64"):
        fp8_linear(torch.randn(2, 65, device=DEVICE).half(), packed)
    with pytest.raises(ValueError, match="contiguous"):
        fp8_linear(torch.randn(64, 2, device=DEVICE).half().T, packed)
    with pytest.raises(ValueError, match="2-D"):
        quantize_act_fp8(torch.randn(64, device=DEVICE))


def test_scaled_mm_alone_and_its_errors():
    torch.manual_seed(2)
    weight, x = torch.randn(40, 96) * 0.05, torch.randn(6, 96).bfloat16()
    packed = pack_fp8(weight.to(DEVICE))
    q_x, s_x = quantize_act_fp8(x.to(DEVICE))
    y = fp8_scaled_mm(q_x, s_x, packed, torch.bfloat16)
    assert torch.equal(y, fp8_linear(x.to(DEVICE), packed))  # fp8_linear = quantize + this
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_scaled_mm(q_x.view(torch.uint8), s_x, packed, torch.bfloat16)
    with pytest.raises(ValueError, match=r"shape \(6,\) or \(\)"):
        fp8_scaled_mm(q_x, s_x[:3], packed, torch.bfloat16)
    with pytest.raises(ValueError, match="in_features 96"):
        fp8_scaled_mm(q_x[:, :64].contiguous(), s_x, packed, torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_scaled_mm(q_x, s_x, packed, torch.float32)
