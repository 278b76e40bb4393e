"""qlab.ptq.smoothquant: SmoothQuant's per-channel scales."""

import numpy as np
import pytest
import torch

from qlab.ptq import smooth_scales
from qlab.ptq.smoothquant import weight_absmax


def _numpy_scales(a, w, alpha):
    """Independent reference: the paper's formula in numpy float64, 1 where a channel is 0."""
    a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = a**alpha / w ** (1 - alpha)
    return np.where((a == 0) | (w == 0), 1.0, s).astype(np.float32)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 0.8, 1.0])
def test_formula_matches_numpy(alpha):
    g = torch.Generator().manual_seed(int(alpha * 100))
    a = torch.rand(300, generator=g) * 20
    w = torch.rand(300, generator=g) * 0.5
    a[[3, 40]] = 0.0  # dead activation channels
    w[[7, 40]] = 0.0  # dead weight columns
    s = smooth_scales(a, w, alpha)
    assert s.dtype == torch.float32 and s.shape == (300,)
    assert torch.equal(s, torch.from_numpy(_numpy_scales(a.numpy(), w.numpy(), alpha)))
    assert torch.equal(s[[3, 7, 40]], torch.ones(3))  # zero channels are left alone
    assert torch.isfinite(s).all() and (s > 0).all()


def test_alpha_extremes_put_all_difficulty_on_one_side():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    x[:, 5] *= 40
    w = torch.randn(16, 32, generator=g)
    a, wm = x.abs().amax(0), weight_absmax(w)
    s1 = smooth_scales(a, wm, 1.0)  # activations flattened: every channel's max becomes 1
    assert torch.allclose((x / s1).abs().amax(0), torch.ones(32), rtol=1e-6)
    s0 = smooth_scales(a, wm, 0.0)  # weights flattened: every column's max becomes 1
    assert torch.allclose((w * s0).abs().amax(0), torch.ones(32), rtol=1e-6)
    s5 = smooth_scales(a, wm, 0.5)  # balanced: both sides end with sqrt(a * w)
    assert torch.allclose((x / s5).abs().amax(0), (w * s5).abs().amax(0), rtol=1e-5)


def test_product_unchanged_and_activation_range_shrinks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 64, generator=g)
    x[:, [2, 9]] *= 60  # outlier channels
    w = torch.randn(48, 64, generator=g) * 0.05
    s = smooth_scales(x.abs().amax(0), weight_absmax(w), 0.5)
    y = (x / s) @ (w * s).T
    assert torch.allclose(y.double(), x.double() @ w.double().T, rtol=0, atol=1e-4)
    ratio_before = float(x.abs().amax(0).max() / x.abs().amax(0).median())
    ratio_after = float((x / s).abs().amax(0).max() / (x / s).abs().amax(0).median())
    assert ratio_after < ratio_before / 5


def test_weight_absmax_is_per_input_channel():
    w = torch.tensor([[1.0, -5.0, 0.0], [-2.0, 3.0, 0.0]])
    assert torch.equal(weight_absmax(w), torch.tensor([2.0, 5.0, 0.0]))
    with pytest.raises(ValueError, match="out_features, in_features"):
        weight_absmax(torch.ones(3))


def test_input_errors_say_what_was_wrong():
    ok = torch.ones(4)
    with pytest.raises(ValueError, match="same length"):
        smooth_scales(ok, torch.ones(5))
    with pytest.raises(ValueError, match="1-d"):
        smooth_scales(torch.ones(2, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match=">= 0"):
        smooth_scales(-ok, ok)
    with pytest.raises(ValueError, match="finite"):
        smooth_scales(ok, torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    for alpha in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="alpha"):
            smooth_scales(ok, ok, alpha)
    assert torch.equal(smooth_scales(np.ones(4), np.ones(4), 1), torch.ones(4))
