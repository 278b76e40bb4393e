"""W4A16 kernels (GEMV for M = 1, swap-AB GEMM otherwise) against qlab.pipelines.w4a16_reference.

The tolerance is derived from the arithmetic in kernels/tolerance.py (fp32 sums in another
order; the GEMM also rounds each weight to 16 bits once); test_bound_catches_* show it
rejects a wrong nibble order and a missing scale by orders of magnitude.
"""

import pytest
import torch

import qlab
from qlab.kernels import DEVICE, W4A16Weight, configs, pack_w4a16, w4a16_linear
from qlab.kernels import w4a16 as w4a16_module
from qlab.kernels.tolerance import first_violation, w4a16_bound
from qlab.pipelines import w4a16_reference


def assert_within_bound(y, x, weight, group_size):
    ref = w4a16_reference(x, weight, group_size)
    w_hat = qlab.dequantize(qlab.quantize(weight, "int4", group_size))
    m = x.reshape(-1, x.shape[-1]).shape[0]
    bound = w4a16_bound(x.reshape(m, -1), w_hat, ref.reshape(m, -1), weights_rounded=m > 1)
    problem = first_violation(y.reshape(m, -1), ref.reshape(m, -1), bound)
    assert problem is None, problem


SHAPES = [  # (M, N, K, group_size): every M bucket, ragged M and N, groups 32..256
    (1, 64, 256, 128),  # GEMV, the decode step (split-K: 2 row blocks for 132 SMs)
    (1, 100, 384, 128),  # GEMV, ragged N (not a multiple of BLOCK_N = 32)
    (1, 40, 96, 32),  # group 32: the K step shrinks to the group
    (1, 48, 512, 256),  # group 256: two K steps per group
    (3, 72, 128, 32),  # GEMM "small" bucket, ragged M and N
    (17, 130, 256, 64),  # "medium" bucket
    (33, 96, 512, 256),  # K step 64 inside a group of 256
    (130, 48, 256, 128),  # "large" bucket, M over one 128-token tile
    (8, 64, 128, 16),  # smallest group: one K step of 16
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


def _launch(m, n, k, g=128, dtype=torch.float16):
    x = torch.empty(m, k, dtype=dtype)  # plan() reads shapes and strides only
    decode_layout = w4a16_module.groups_per_step(g, k) is not None
    words = torch.empty(-(-n // 32), 4 * k, dtype=torch.int32) if decode_layout else None
    w = W4A16Weight(torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // g).half(),
                    g, (n, k), words)  # fmt: skip
    config = configs.configs_for("w4a16", m)[0]
    return w4a16_module.plan(x, w, torch.empty(m, n, dtype=dtype), config, configs.H100_SMS)


def test_split_k_fills_an_h100_and_is_deterministic():
    # N = K = 4096 at decode: 32 row blocks of 128 would leave 100 of 132 SMs idle; split-K
    # 16 gives 512 programs, >= 2 per SM.
    launch = _launch(1, 4096, 4096)
    assert launch.kernel is w4a16_module._w4a16_gemv_mma_kernel
    assert launch.grid == (32, 16)
    assert launch.grid[0] * launch.grid[1] >= 2 * configs.H100_SMS
    # a large layer needs no split
    assert _launch(1, 57344, 8192).grid == (448, 1)
    # a group of 16 (no decode layout): the plain-layout GEMV, 128 blocks of 32 rows
    assert _launch(1, 4096, 4096, g=16).kernel is w4a16_module._w4a16_gemv_kernel
    assert _launch(1, 4096, 4096, g=16).grid == (128, 4)
    assert _launch(1, 4096, 4096, g=64).kernel is w4a16_module._w4a16_gemv_mma_kernel
    # the interpreter takes the same path: 1 row block x 4 splits of K = 512
    torch.manual_seed(5)
    weight, x = torch.randn(64, 512) * 0.05, torch.randn(1, 512).half()
    packed = pack_w4a16(weight.to(DEVICE), 128)
    assert _launch(1, 64, 512).grid == (1, 4)
    y1, y2 = w4a16_linear(x.to(DEVICE), packed), w4a16_linear(x.to(DEVICE), packed)
    assert torch.equal(y1, y2)  # partial sums added in a fixed order
    assert_within_bound(y1, x, weight, 128)


@pytest.mark.parametrize("m", [1, 16])
def test_plan_reports_the_k_step_it_launches(m):
    # g = 64 without the decode layout (words None): the plain GEMV (M = 1, GEMV_PLAIN's 128)
    # and the GEMM configs of 128 shrink their K step to 64; the Launch's config (recorded by
    # the benchmark) must say 64 too.
    w = W4A16Weight(torch.empty(64, 128, dtype=torch.uint8), torch.empty(64, 4).half(),
                    64, (64, 256), None)  # fmt: skip
    x, out = torch.empty(m, 256).half(), torch.empty(m, 64).half()
    for config in configs.configs_for("w4a16", m):
        launch = w4a16_module.plan(x, w, out, config, configs.H100_SMS)
        assert launch.config.block_k == launch.meta["BLOCK_K"] == 64, (config, launch.config)
        assert launch.describe()["config"]["block_k"] == 64


def test_from_qtensor_is_exactly_what_the_kernel_reads():
    torch.manual_seed(3)
    weight = torch.randn(24, 256)
    qt = qlab.quantize(weight, "int4", 64)
    w = W4A16Weight.from_qtensor(qt)
    assert w.shape == (24, 256) and w.group_size == 64
    assert torch.equal(w.packed, qlab.pack_int4(qt.codes))
    assert torch.equal(w.scales, qt.scales) and w.scales.dtype == torch.float16
    same = pack_w4a16(weight, 64)
    assert torch.equal(same.packed.cpu(), w.packed) and torch.equal(same.scales.cpu(), w.scales)
    assert w.nbytes == 24 * 128 + 24 * 4 * 2


def test_from_qtensor_takes_gptq_style_codes_including_minus_8():
    # GPTQ-like: codes chosen by error feedback, not by rounding W / s; -8 is legal in a nibble.
    torch.manual_seed(4)
    codes = torch.randint(-8, 8, (32, 128), dtype=torch.int8)
    scales = (torch.rand(32, 1) + 0.5).half() / 100
    qt = qlab.QTensor(codes, scales, None, qlab.get_scheme("int4"), 128)
    w = W4A16Weight.from_qtensor(qt)
    x = torch.randn(5, 128).half()
    for rows in (1, 5):  # GEMV and GEMM
        on_device = {f: getattr(w, f).to(DEVICE) for f in ("packed", "scales", "words")
                     if getattr(w, f) is not None}
        y = w4a16_linear(x[:rows].to(DEVICE), w._replace(**on_device))
        w_hat = codes.float() * scales.float()
        ref = x[:rows].float() @ w_hat.T
        problem = first_violation(y, ref, w4a16_bound(x[:rows], w_hat, ref, rows > 1))
        assert problem is None, problem


def test_from_qtensor_rejects_what_the_kernel_cannot_read():
    weight = torch.randn(8, 64)
    with pytest.raises(TypeError, match="scheme 'int4'"):
        W4A16Weight.from_qtensor(qlab.quantize(weight, "int8", 32))
    with pytest.raises(TypeError, match="scheme 'int4'"):
        W4A16Weight.from_qtensor(weight)
    with pytest.raises(ValueError, match="int group size"):
        W4A16Weight.from_qtensor(qlab.quantize(weight, "int4", "channel"))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        W4A16Weight.from_qtensor(qlab.quantize(weight, "int4", 8))
    qt = qlab.quantize(weight, "int4", 32)
    with pytest.raises(TypeError, match="float16"):
        W4A16Weight.from_qtensor(qlab.QTensor(qt.codes, qt.scales.float(), None, qt.scheme, 32))
    with pytest.raises(ValueError, match="2-D"):
        W4A16Weight.from_qtensor(qlab.quantize(torch.randn(2, 4, 64), "int4", 32))


def test_batched_input_and_empty():
    weight = torch.randn(32, 64)
    packed = pack_w4a16(weight.to(DEVICE), 32)
    x = torch.randn(2, 3, 64).half()
    y = w4a16_linear(x.to(DEVICE), packed)
    assert y.shape == (2, 3, 32)
    assert_within_bound(y.reshape(6, 32), x.reshape(6, 64), weight, 32)
    empty = torch.empty(0, 64, dtype=torch.half, device=DEVICE)
    assert w4a16_linear(empty, packed).shape == (0, 32)


def test_unaligned_activations_still_work():
    # The GEMV reads x as 32-bit words: a view starting one element in must not break it.
    torch.manual_seed(6)
    weight, big = torch.randn(40, 128) * 0.1, torch.randn(1, 129).half()
    x = big[:, 1:]  # contiguous, but 2 bytes past an aligned address
    y = w4a16_linear(x.to(DEVICE), pack_w4a16(weight.to(DEVICE), 64))
    assert_within_bound(y, x, weight, 64)


@pytest.mark.parametrize("m", [1, 4])
def test_bound_catches_a_wrong_nibble_order(m):
    # Swap the nibbles of every byte: the kernel must then fail the bound (GEMV and GEMM).
    torch.manual_seed(0)
    weight, x = torch.randn(32, 64), torch.randn(m, 64).half()
    good = pack_w4a16(weight.to(DEVICE), 32)
    swapped = good._replace(packed=(good.packed >> 4) | (good.packed << 4))
    assert_within_bound(w4a16_linear(x.to(DEVICE), good), x, weight, 32)
    with pytest.raises(AssertionError, match="element"):
        assert_within_bound(w4a16_linear(x.to(DEVICE), swapped), x, weight, 32)


def test_bound_catches_a_scale_off_by_one_group():
    # Scales shifted by one group (the classic k // g indexing slip) must fail too.
    torch.manual_seed(1)
    weight, x = torch.randn(32, 128), torch.randn(3, 128).half()
    good = pack_w4a16(weight.to(DEVICE), 32)
    shifted = good._replace(scales=good.scales.roll(1, dims=1))
    with pytest.raises(AssertionError, match="element"):
        assert_within_bound(w4a16_linear(x.to(DEVICE), shifted), x, weight, 32)


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
