"""W4A16 kernels (GEMV for M = 1, tiled GEMM otherwise) against qlab.pipelines.w4a16_reference.

Tolerance, element by element, from the arithmetic rather than a guess:
  * both sides multiply exactly (16-bit x times a 4-bit code is exact in fp32) and sum
    in fp32 in different orders: each is within K * 2**-24 * (|x| @ |W_hat|.T) of the
    exact sum, so they differ by at most K * 2**-23 of it;
  * the kernel then rounds y to x's dtype: at most one ulp, 2**-10 |y| in fp16 and
    2**-7 |y| in bf16 (one ulp, not half: the CPU interpreter truncates fp32 -> bf16),
    plus fp16's smallest subnormal for results near 0.
A wrong nibble order, sign extension, group index or scale breaks this by orders of
magnitude (test_bound_catches_a_wrong_nibble_order shows it).
"""

import pytest
import torch

import qlab
from qlab.kernels import DEVICE, W4A16Weight, pack_w4a16, w4a16_linear
from qlab.pipelines import w4a16_reference

ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_within_bound(y, x, weight, group_size):
    ref = w4a16_reference(x, weight, group_size)
    w_hat = qlab.dequantize(qlab.quantize(weight, "int4", group_size))
    k = weight.shape[1]
    magnitude = x.float().abs() @ w_hat.abs().T
    bound = k * 2.0**-23 * magnitude + ULP[x.dtype] * ref.abs() + 2.0**-24
    err = (y.float().cpu() - ref).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"element {worst}: got {y.float().flatten()[worst].item()}, "
        f"expected {ref.flatten()[worst].item()} (bound {bound.flatten()[worst].item():.3g})"
    )


SHAPES = [  # (M, N, K, group_size)
    (1, 64, 256, 128),  # GEMV, the decode step
    (1, 100, 384, 128),  # GEMV, ragged N (not a multiple of BLOCK_N = 32)
    (1, 40, 96, 32),
    (3, 72, 128, 32),  # GEMM, ragged M and N
    (17, 130, 256, 64),
    (33, 96, 512, 128),
    (130, 48, 256, 128),  # M over one 128-row tile
    (8, 64, 128, 16),  # smallest group: one K tile of 16
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, group_size", SHAPES)
def test_matches_reference(m, n, k, group_size, dtype):
    torch.manual_seed(m * 1000 + n + k)
    weight = torch.randn(n, k) * 0.05
    weight[0, :3] = 0.8  # an outlier group
    x = torch.randn(m, k).to(dtype)
    packed = pack_w4a16(weight.to(DEVICE, dtype), group_size)
    y = w4a16_linear(x.to(DEVICE), packed)
    assert y.dtype == dtype and y.shape == (m, n)
    # pack_w4a16 quantized the dtype-rounded weight: the reference must too.
    assert_within_bound(y, x, weight.to(dtype), group_size)


def test_packing_is_qlabs():
    weight = torch.randn(24, 64)
    packed = pack_w4a16(weight, 32)
    qt = qlab.quantize(weight, "int4", 32)
    assert isinstance(packed, W4A16Weight) and packed.shape == (24, 64)
    assert torch.equal(packed.packed.cpu(), qlab.pack_int4(qt.codes))
    assert torch.equal(packed.scales.cpu(), qt.scales) and packed.scales.dtype == torch.float16
    assert packed.nbytes == 24 * 32 + 24 * 2 * 2


def test_batched_input_and_empty():
    weight = torch.randn(32, 64)
    packed = pack_w4a16(weight.to(DEVICE), 32)
    x = torch.randn(2, 3, 64).half()
    y = w4a16_linear(x.to(DEVICE), packed)
    assert y.shape == (2, 3, 32)
    assert_within_bound(y.reshape(6, 32), x.reshape(6, 64), weight, 32)
    assert w4a16_linear(torch.empty(0, 64, dtype=torch.half, device=DEVICE), packed).shape == (
        0,
        32,
    )


def test_bound_catches_a_wrong_nibble_order():
    # Swap the nibbles of every byte: the kernel must then fail the bound.
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.randn(4, 64).half()
    good = pack_w4a16(weight, 32)
    swapped = good._replace(packed=(good.packed >> 4) | (good.packed << 4))
    with pytest.raises(AssertionError, match="element"):
        assert_within_bound(w4a16_linear(x.to(DEVICE), swapped), x, weight, 32)


def test_bad_inputs_raise_clear_errors():
    weight = torch.randn(32, 64)
    packed = pack_w4a16(weight.to(DEVICE), 32)
    with pytest.raises(ValueError, match="2-D"):
        pack_w4a16(torch.randn(64), 32)
    with pytest.raises(TypeError, match="floating-point"):
        pack_w4a16(torch.ones(4, 64, dtype=torch.int32), 32)
    with pytest.raises(ValueError, match="does not divide in_features K = 64"):
        pack_w4a16(weight, 48)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        pack_w4a16(weight, 8)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        w4a16_linear(x, packed)  # fp32 activations
    with pytest.raises(ValueError, match="in_features K = 64"):
        w4a16_linear(torch.randn(2, 32, device=DEVICE).half(), packed)
    with pytest.raises(ValueError, match="contiguous"):
        w4a16_linear(torch.randn(64, 2, device=DEVICE).half().T, packed)
    with pytest.raises(TypeError, match="pack_w4a16"):
        w4a16_linear(x.half(), weight)
