"""FP8 W8A8 kernels against qlab: activation codes and scales bit-exact, the GEMM within
a bound derived from its arithmetic (kernels/tolerance.py, see assert_within_bound)."""

import pytest
import torch
import triton
import triton.language as tl

import qlab
from qlab.kernels import (
    DEVICE,
    INTERPRET,
    FP8Weight,
    configs,
    fp8_linear,
    fp8_scaled_mm,
    pack_fp8,
    quantize_act_fp8,
)
from qlab.kernels import fp8 as fp8_module
from qlab.kernels.fp8 import round_to_e4m3
from qlab.kernels.tolerance import first_violation, fp8_bound
from qlab.pipelines import w8a8_reference

E4M3 = qlab.formats.get("fp8_e4m3fn")


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
    bad = (y.cpu().view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
    assert len(bad) == 0, [(x[i].item(), y[i].item(), want[i].item()) for i in bad[:8]]


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


def assert_within_bound(y, x, weight, w_gran, a_gran, fast_accum=False):
    """kernels/tolerance.py: same exact fp8 x fp8 products, fp32 sums in another order, the
    rounding of y to x's dtype, and on a GPU the FP8 MMA's reduced-precision accumulation."""
    ref = w8a8_reference(x, weight, "fp8_e4m3", w_gran, a_gran)
    qx = qlab.quantize(x, "fp8_e4m3", "channel" if a_gran == "token" else "tensor")
    qw = qlab.quantize(weight, "fp8_e4m3", w_gran)
    bound = fp8_bound(qlab.dequantize(qx), qlab.dequantize(qw), ref, x.dtype, mma=not INTERPRET,
                      fast_accum=fast_accum)  # fmt: skip
    problem = first_violation(y, ref, bound)
    assert problem is None, problem


SHAPES = [  # (M, N, K): every M bucket; swap-AB up to 128 tokens, grouped tiles above
    (1, 64, 128),  # decode: swap-AB, one 64-feature tile
    (5, 72, 208),  # ragged K: not a multiple of BLOCK_K = 128 (K % 16 == 0 is required)
    (1, 96, 1024),  # split-K: 2 feature tiles, K split 8 ways
    (33, 130, 256),  # "medium" bucket
    (130, 40, 128),  # "large" bucket: grouped 128 x 128 tiles
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


@pytest.mark.parametrize("m", [1, 130])
def test_fast_accumulation_within_its_bound(m):
    torch.manual_seed(m)
    weight, x = torch.randn(48, 384) * 0.05, torch.randn(m, 384).bfloat16()
    y = fp8_linear(x.to(DEVICE), pack_fp8(weight.to(DEVICE)), fast_accum=True)
    assert_within_bound(y, x, weight, "channel", "token", fast_accum=True)


def _plan(m, n, k, fast_accum=False):
    f8 = torch.float8_e4m3fn
    w = FP8Weight(torch.empty(n, k, dtype=f8), torch.empty(n), "channel")  # shapes only
    q_x, s_x = torch.empty(m, k, dtype=f8), torch.empty(m)
    config = configs.configs_for("fp8", m)[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    return fp8_module.plan_gemm(q_x, s_x, w, out, config, configs.H100_SMS, fast_accum)


def test_swap_ab_below_129_tokens_split_k_and_grouped_order_above():
    small = _plan(1, 4096, 4096)
    assert small.kernel is fp8_module._fp8_gemm_swap_kernel
    assert small.grid == (64, 8)  # 64 tiles of 64 features, K split 8 ways: 512 programs
    assert _plan(128, 4096, 4096).kernel is fp8_module._fp8_gemm_swap_kernel
    large = _plan(4096, 4096, 4096)
    assert large.kernel is fp8_module._fp8_gemm_kernel and large.grid == (32 * 32,)
    assert large.meta["GROUP_M"] == 8
    # precise accumulation promotes every K step; fast leaves it to the MMA
    assert large.meta["MAX_IMPRECISE"] == 128
    assert _plan(4096, 4096, 4096, fast_accum=True).meta["MAX_IMPRECISE"] is None


def test_per_token_quantization_is_one_launch(monkeypatch):
    launched = []
    real = configs.Launch.__call__
    monkeypatch.setattr(configs.Launch, "__call__",
                        lambda self: launched.append(self.kernel) or real(self))  # fmt: skip
    x = torch.randn(4, 300).half().to(DEVICE)
    quantize_act_fp8(x, "token")
    assert launched == [fp8_module._act_quant_kernel]


def test_long_rows_take_two_passes_bit_exact():
    # K above ONE_PASS_MAX_K: the row is read twice (amax, then quantize), same codes.
    torch.manual_seed(7)
    k = fp8_module.ONE_PASS_MAX_K + 200
    x = torch.randn(2, k).bfloat16() * torch.tensor([[1.0], [1e-3]]).bfloat16()
    for gran, qgran in (("token", "channel"), ("tensor", "tensor")):
        codes, scales = quantize_act_fp8(x.to(DEVICE), gran)
        qt = qlab.quantize(x, "fp8_e4m3", qgran)
        assert torch.equal(codes.cpu().view(torch.uint8), qt.codes)
        assert torch.equal(scales.cpu(), qt.scales.reshape(scales.shape))


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
    with pytest.raises(TypeError, match="float16 or bfloat16 or float32"):
        quantize_act_fp8(torch.ones(2, 64, dtype=torch.int32, device=DEVICE))


def test_scaled_mm_alone_and_its_errors():
    torch.manual_seed(2)
    weight, x = torch.randn(40, 96) * 0.05, torch.randn(6, 96).bfloat16()
    packed = pack_fp8(weight.to(DEVICE))
    q_x, s_x = quantize_act_fp8(x.to(DEVICE))
    y = fp8_scaled_mm(q_x, s_x, packed, torch.bfloat16)
    assert torch.equal(y, fp8_linear(x.to(DEVICE), packed))  # fp8_linear = quantize + this
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_scaled_mm(q_x.view(torch.uint8), s_x, packed, torch.bfloat16)
    with pytest.raises(ValueError, match=r"shape \(6,\) or \(\)"):
        fp8_scaled_mm(q_x, s_x[:3], packed, torch.bfloat16)
    with pytest.raises(ValueError, match="in_features K = 96"):
        fp8_scaled_mm(q_x[:, :64].contiguous(), s_x, packed, torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_scaled_mm(q_x, s_x, packed, torch.float32)
