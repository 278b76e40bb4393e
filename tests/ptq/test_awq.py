"""qlab.ptq.awq: the scale formula, the search, and "never worse than RTN", checked with
objectives computed directly from X (not through H, which qlab uses)."""

import numpy as np
import pytest
import torch

import qlab
from qlab.ptq import awq, hessian
from qlab.ptq.awq import act_mean_abs, awq_clip, awq_scales, awq_search, awq_weight
from qlab.ptq.gptq import layer_error


def salient_inputs(n: int, k: int, seed: int, n_salient: int = 4, dead: int = 0):
    """Inputs whose first n_salient channels are 20x larger, like LLM outlier features;
    the last `dead` channels are always 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g)
    x[:, :n_salient] *= 20.0
    if dead:
        x[:, -dead:] = 0.0
    return x


def direct_error(x, w, w_hat) -> float:
    return float(((x.double() @ w.double().T - x.double() @ w_hat.double().T) ** 2).mean())


def test_scale_formula_against_numpy():
    x = salient_inputs(256, 64, seed=1, dead=2).numpy()
    mean_abs = np.abs(x).mean(axis=0)
    for alpha in (0.0, 0.35, 0.95):
        s = np.maximum(mean_abs.astype(np.float64) ** alpha, 1e-4)
        s = s / np.sqrt(s.max() * s.min())
        got = awq_scales(act_mean_abs(torch.from_numpy(x)), alpha)
        assert got.dtype == torch.float32 and got.shape == (64,)
        np.testing.assert_allclose(got.numpy(), s, rtol=2e-6)  # float32 pow vs float64
    assert torch.equal(awq_scales(act_mean_abs(torch.from_numpy(x)), 0.0), torch.ones(64))


def test_alpha_zero_is_rtn():
    x, w = salient_inputs(512, 128, seed=2), torch.randn(16, 128) * 0.1
    assert torch.equal(awq_weight(w, torch.ones(128), "int4", 32),
                       qlab.fake_quantize(w, "int4", 32))
    r = awq_search(w, x, "int4", 32)
    assert r.alphas[0] == 0.0 and len(r.alphas) == 20 and r.alphas[-1] == 0.95
    assert r.errors[0] == pytest.approx(direct_error(x, w, qlab.fake_quantize(w, "int4", 32)),
                                        rel=1e-6)


@pytest.mark.parametrize("scheme,g", [("int4", 32), ("int3", 64), ("int4_asym", 32),
                                      ("int2", 16), ("int8", None)])
@pytest.mark.parametrize("seed", [3, 4])
def test_never_worse_than_rtn_on_its_objective(scheme, g, seed):
    x = salient_inputs(512, 128, seed=seed, n_salient=seed - 2, dead=3)
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(seed)) * 0.05
    qt, s = awq(w, x, scheme, g)
    y_awq = (x / s) @ qt.dequantize().T  # what the deployed layer computes
    e_awq = float(((x @ w.T - y_awq).double() ** 2).mean())
    e_rtn = direct_error(x, w, qlab.fake_quantize(w, scheme, "channel" if g is None else g))
    assert e_awq <= e_rtn * (1 + 1e-5)  # float32 (x / s) @ W_q vs x @ (W_q / s): ~1e-6
    assert qt.codes.shape == w.shape and torch.isfinite(s).all() and bool((s > 0).all())


def test_protects_salient_channels():
    # the situation AWQ is built for: a few input channels 20x larger than the rest
    x = salient_inputs(2048, 256, seed=5)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.02
    r = awq_search(w, x, "int3", 64)
    # a real scaling was chosen, not alpha = 0 (0.25 here; 0.2 to 0.35 over weight seeds 0-29)
    assert r.best_alpha >= 0.2
    assert min(r.errors) < 0.7 * r.errors[0]  # 0.40x of RTN's error here (0.37-0.53 by seed)
    assert r.scales[:4].min() > r.scales[4:].max()  # the salient channels scaled up most


def test_search_objective_is_the_direct_output_error():
    x, w = salient_inputs(1024, 64, seed=6, dead=1), torch.randn(16, 64) * 0.1
    r = awq_search(w, x, "int4", 32, n_grid=5)
    for alpha, err in zip(r.alphas, r.errors, strict=True):
        w_hat = awq_weight(w, awq_scales(act_mean_abs(x), alpha), "int4", 32)
        assert err == pytest.approx(direct_error(x, w, w_hat), rel=1e-5)  # H in float32
    assert r.errors[r.alphas.index(r.best_alpha)] == min(r.errors)
    assert layer_error(w, w, hessian(x)) == 0.0


def test_clip_search_never_increases_group_error():
    x, w = salient_inputs(1024, 128, seed=7), torch.randn(32, 128) * 0.05
    w[:, 5] *= 6.0  # a few large weights: clipping them can pay
    clipped = awq_clip(w, x, "int3", 32)
    assert clipped.abs().le(w.abs() + 1e-7).all()  # only ever shrinks
    xs = x[:: 1024 // 512]
    for lo in range(0, 128, 32):  # per group, on the sampled tokens it optimises
        part = lambda v, lo=lo: xs[:, lo:lo + 32] @ v[:, lo:lo + 32].T  # noqa: E731
        e_clip = float(((part(qlab.fake_quantize(clipped, "int3", 32)) - part(w)) ** 2).mean())
        e_none = float(((part(qlab.fake_quantize(w, "int3", 32)) - part(w)) ** 2).mean())
        assert e_clip <= e_none * (1 + 1e-5)


def test_bad_inputs_raise_clear_errors():
    w, x = torch.randn(8, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="K = 64"):
        awq(w, torch.randn(32, 48), "int4", 32)
    with pytest.raises(ValueError, match="does not divide"):
        awq(w, x, "int4", 48)
    with pytest.raises(ValueError, match="integer schemes"):
        awq(w, x, "mxfp4", 32)
    with pytest.raises(ValueError, match="n_grid"):
        awq(w, x, "int4", 32, n_grid=0)
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        awq(torch.randn(64), x, "int4", 32)
