"""qlab.ptq.llm_int8: LLM.int8()'s mixed-precision decomposition."""

import pytest
import torch

from qlab.pipelines import w8a8_reference
from qlab.ptq import mixed_precision_matmul
from qlab.ptq.llm_int8 import outlier_columns


def _by_hand(x, w, threshold):
    """Independent reference in plain torch (no qlab): fp16 outlier columns + int8 vector-wise
    (per-token and per-output-channel absmax / 127 as float16, RNE, clamp, exact int sums)."""
    cols = (x.abs() >= threshold).any(dim=0)
    y16 = x[:, cols].half().float() @ w[:, cols].half().float().T
    xr, wr = x.masked_fill(cols, 0.0), w.masked_fill(cols, 0.0)
    sx = (xr.abs().amax(1) / 127).half().float()
    sw = (wr.abs().amax(1) / 127).half().float()
    qx = torch.clamp(torch.round(xr / torch.where(sx == 0, 1.0, sx)[:, None]), -127, 127)
    qw = torch.clamp(torch.round(wr / torch.where(sw == 0, 1.0, sw)[:, None]), -127, 127)
    acc = (qx.double() @ qw.double().T).float()
    return y16 + acc * (sx[:, None] * sw[None, :])


def _data(seed, m=24, k=64, n=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, [5, 17]] *= 25.0  # two outlier channels, in every token
    x[3, 30] = -9.0  # one outlier value in one token: its whole column goes to 16 bit
    return x, torch.randn(n, k, generator=g) * 0.1


@pytest.mark.parametrize("seed", range(5))
def test_matches_an_independent_implementation(seed):
    x, w = _data(seed)
    y = mixed_precision_matmul(x, w, 6.0)
    # same integer sums; the final rescale and the fp32 sums of the 16-bit part may be ordered
    # differently: a few float32 ulps of |y| (~20 here)
    assert torch.allclose(y, _by_hand(x, w, 6.0), rtol=1e-6, atol=1e-5)


def test_columns_chosen_by_any_token_at_or_above_threshold():
    x, _ = _data(0)
    cols = outlier_columns(x, 6.0)
    assert cols.dtype == torch.bool and cols[[5, 17, 30]].all()
    assert int(cols.sum()) == int((x.abs() >= 6).any(0).sum())
    edge = torch.zeros(2, 4)
    edge[1, 2] = -6.0  # exactly the threshold counts (bitsandbytes: |x| >= threshold)
    assert outlier_columns(edge, 6.0).tolist() == [False, False, True, False]
    assert outlier_columns(edge, 6.0001).tolist() == [False] * 4


def test_limits_no_outliers_is_w8a8_every_column_is_fp16():
    x, w = _data(1)
    assert torch.equal(mixed_precision_matmul(x, w, float("inf")),
                       w8a8_reference(x, w, "int8", "channel", "token"))
    assert torch.equal(mixed_precision_matmul(x, w, 0.0), x.half().float() @ w.half().float().T)


def test_decomposition_beats_per_token_int8_when_outliers_exist():
    x, w = _data(2)
    exact = x.double() @ w.double().T
    err_mixed = (mixed_precision_matmul(x, w).double() - exact).abs().max()
    err_int8 = (w8a8_reference(x, w, "int8", "channel", "token").double() - exact).abs().max()
    assert err_mixed < err_int8 / 5
    # what is left is the int8 rounding of the small columns: ~|x| |w| sqrt(K) / 127 scale
    assert err_mixed < 0.05


def test_leading_dimensions_and_zero_rows():
    x, w = _data(3)
    x3 = x.reshape(4, 6, 64)
    y2 = mixed_precision_matmul(x, w)
    assert torch.equal(mixed_precision_matmul(x3, w), y2.reshape(4, 6, 40))
    x0 = torch.zeros(3, 64)
    x0[1, 5] = 50.0  # a token whose only non-zero entry is an outlier: its int8 row is all zero
    assert torch.allclose(mixed_precision_matmul(x0, w), _by_hand(x0, w, 6.0), rtol=1e-6)


def test_input_errors():
    x, w = _data(4)
    with pytest.raises(ValueError, match="share K"):
        mixed_precision_matmul(x, w[:, :10])
    with pytest.raises(ValueError, match="threshold"):
        mixed_precision_matmul(x, w, -1.0)
    with pytest.raises(ValueError, match="float16"):
        mixed_precision_matmul(x * 1e4, w)
    with pytest.raises(TypeError, match="dtype"):
        mixed_precision_matmul(x.long(), w)
