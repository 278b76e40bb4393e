"""The primer kernel against qlab: bit-exact (rtol=0, atol=0), the arithmetic is the same."""

import pytest
import torch

import qlab
from qlab.kernels import DEVICE, dequantize_int4


@pytest.mark.parametrize(
    "shape, group_size",
    [
        ((1, 32), 32),
        ((7, 256), 64),  # ragged rows: 7 is not a multiple of BLOCK_R
        ((33, 384), 128),  # ragged columns: 384 is not a multiple of BLOCK_K = 128 * 2
        ((5, 96), 16),
        ((2, 3, 128), 32),  # leading batch dimensions
        ((4, 130), 2),  # a group of 2: every byte has its own scale
    ],
)
def test_matches_qlab_dequantize_bit_exact(shape, group_size):
    torch.manual_seed(sum(shape) + group_size)
    w = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 4  # rows of different ranges
    qt = qlab.quantize(w, "int4", group_size)
    packed = qlab.pack_int4(qt.codes)
    got = dequantize_int4(packed.to(DEVICE), qt.scales.to(DEVICE), group_size)
    want = qlab.dequantize(qt)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def test_every_nibble_including_minus_8():
    # qlab's int4 uses -7..7, but the nibble -8 (0x8) must sign-extend too.
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # shape: (3, 64)
    scales = torch.tensor([[0.5, -2.0], [1.0, 3.0], [0.1, 7.0]], dtype=torch.float16)
    got = dequantize_int4(qlab.pack_int4(codes).to(DEVICE), scales.to(DEVICE), 32).cpu()
    want = codes.float() * scales.float().repeat_interleave(32, dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp32_scales_and_empty():
    codes = torch.randint(-7, 8, (3, 64), dtype=torch.int8)
    scales = torch.rand(3, 4) + 0.5  # float32 scales are accepted as they are
    got = dequantize_int4(qlab.pack_int4(codes).to(DEVICE), scales.to(DEVICE), 16).cpu()
    torch.testing.assert_close(got, codes.float() * scales.repeat_interleave(16, 1), rtol=0, atol=0)
    empty = dequantize_int4(torch.empty(0, 8, dtype=torch.uint8, device=DEVICE),
                            torch.empty(0, 1, device=DEVICE), 16)  # fmt: skip
    assert empty.shape == (0, 16)


def _inputs(rows=4, k=64, g=32):
    qt = qlab.quantize(torch.randn(rows, k), "int4", g)
    return qlab.pack_int4(qt.codes).to(DEVICE), qt.scales.to(DEVICE)


def test_bad_inputs_raise_clear_errors():
    packed, scales = _inputs()
    with pytest.raises(TypeError, match="uint8"):
        dequantize_int4(packed.to(torch.int8), scales, 32)
    with pytest.raises(TypeError, match="float16 or float32"):
        dequantize_int4(packed, scales.to(torch.bfloat16), 32)
    with pytest.raises(ValueError, match="does not divide the last dimension"):
        dequantize_int4(packed, scales, 48)
    with pytest.raises(ValueError, match="expected"):
        dequantize_int4(packed, scales[:, :1], 32)
    with pytest.raises(ValueError, match="positive int"):
        dequantize_int4(packed, scales, 0)
    wide = torch.zeros(4, 64, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_int4(wide[:, ::2], scales, 32)


def test_16_bit_output_is_the_exact_value_rounded_once():
    torch.manual_seed(9)
    qt = qlab.quantize(torch.randn(6, 256) * 3, "int4", 64)
    packed, scales = qlab.pack_int4(qt.codes).to(DEVICE), qt.scales.to(DEVICE)
    exact = qlab.dequantize(qt)
    half = dequantize_int4(packed, scales, 64, out_dtype=torch.float16).cpu()
    assert half.dtype == torch.float16 and torch.equal(half, exact.half())  # round to nearest
    # bf16: one rounding; within one unit in the last place (the CPU interpreter truncates)
    bf16 = dequantize_int4(packed, scales, 64, out_dtype=torch.bfloat16).cpu()
    assert bf16.dtype == torch.bfloat16
    assert bool(((bf16.float() - exact).abs() <= exact.abs() * 2.0**-7).all())
    with pytest.raises(TypeError, match="out_dtype"):
        dequantize_int4(packed, scales, 64, out_dtype=torch.int8)


def test_offsets_past_2_31_switch_the_kernel_to_64_bit_rows():
    # A (131072, 16384) weight dequantized has 2**31 elements: row * stride would wrap in
    # int32, so the launch asks for int64 row offsets; a 4096 x 4096 one keeps int32.
    from qlab.kernels import dequant

    def launch(n, k, g=128):
        def meta(*shape, dtype):  # tensors without memory: only shapes and strides matter
            return torch.empty(shape, dtype=dtype, device="meta")

        return dequant.plan(meta(n, k // 2, dtype=torch.uint8),
                            meta(n, k // g, dtype=torch.float16),
                            meta(n, k, dtype=torch.float32), g)  # fmt: skip

    assert launch(131072, 16384).meta["INDEX_64"] is True
    assert launch(4096, 4096).meta["INDEX_64"] is False
