"""W4A16 / W8A8 references: dequantize-then-matmul vs quantized accumulate + one rescale."""

import pytest
import torch

import qlab
from qlab.pipelines import w4a16_reference, w8a8_reference


@pytest.fixture
def xw():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 256, generator=g), torch.randn(64, 256, generator=g) * 0.05


def test_w4a16_is_dequantize_then_matmul(xw):
    x, w = xw
    w_hat = qlab.fake_quantize(w, "int4", 128)
    assert torch.equal(w4a16_reference(x, w, 128), x @ w_hat.T)
    y = x @ w.T
    assert qlab.metrics.sqnr_db(y, w4a16_reference(x, w, 128)) > 15


@pytest.mark.parametrize("scheme", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("act", ["token", "tensor"])
def test_w8a8_rescale_once_equals_fake_quant_matmul(xw, scheme, act):
    x, w = xw
    y = w8a8_reference(x, w, scheme, "channel", act)
    x_hat = qlab.fake_quantize(x, scheme, "channel" if act == "token" else "tensor")
    w_hat = qlab.fake_quantize(w, scheme, "channel")
    # same math, different association: (sum e_x e_w) s_x s_w vs sum (e_x s_x)(e_w s_w);
    # both fp32, K = 256 terms -> agree to ~1e-6 relative
    ref = x_hat.double() @ w_hat.double().T
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert qlab.metrics.sqnr_db(x @ w.T, y) > 25


def test_w8a8_bad_args(xw):
    x, w = xw
    with pytest.raises(ValueError):
        w8a8_reference(x, w, act_granularity="row")
