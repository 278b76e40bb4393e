"""LSQ: forward equals qlab's integer fake quantization at the same scale; gradients match an
independent autograd implementation (clamp, round with an STE, the gradient-scale trick),
finite differences where the derivative exists, and the stated boundary convention."""

import math

import pytest
import torch

import qlab
from qlab.qat import LSQQuantizer, lsq_fake_quantize, lsq_grad_scale


def _reference_lsq(x, scale, qmax, g):
    """LSQ as usually written in PyTorch (no custom backward): the step's gradient is
    scaled by g with s*g + (s - s*g).detach(), rounding passes straight through with
    u + (round(u) - u).detach(), and clamp's autograd does the rest (ends included)."""
    s = scale * g + (scale - scale * g).detach()
    s = s.repeat_interleave(x.shape[-1] // scale.shape[-1], dim=-1)
    u = torch.clamp(x / s, -qmax, qmax)
    return (u + (torch.round(u) - u).detach()) * s


def _case(seed: int, bits: int = 3, rows: int = 4, k: int = 64, gs: int = 16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    qmax = 2 ** (bits - 1) - 1
    amax = x.reshape(rows, k // gs, gs).abs().amax(-1)
    scale = (0.4 + torch.rand(amax.shape, generator=gen)) * amax / qmax  # some groups clamp
    return x, scale, qmax, torch.randn(rows, k, generator=gen)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_forward_equals_qlab_at_qlabs_scale(bits):
    for gran in ("channel", 16, "tensor"):
        w = torch.randn(8, 64) * 0.05
        w[0, :16] = 0.0  # a zero group: scale 0 -> divide by 1 -> zeros
        qt = qlab.quantize(w, f"int{bits}", gran)
        y = lsq_fake_quantize(w, qt.scales.float(), bits, 1.0)
        assert torch.equal(y, qlab.fake_quantize(w, f"int{bits}", gran)), (bits, gran)


@pytest.mark.parametrize("seed", range(4))
def test_gradients_match_an_independent_autograd_implementation(seed):
    x, scale, qmax, grad_y = _case(seed)
    g = lsq_grad_scale(16, qmax)
    xa, sa = x.clone().requires_grad_(True), scale.clone().requires_grad_(True)
    lsq_fake_quantize(xa, sa, 3, g).backward(grad_y)
    xb, sb = x.clone().requires_grad_(True), scale.clone().requires_grad_(True)
    yb = _reference_lsq(xb, sb, qmax, g)
    yb.backward(grad_y)
    # the reference's forward multiplies by s*g + (s - s*g), and its x gradient is
    # (grad * s) / s: each a float32 rounding or two away from ours, no more
    assert torch.allclose(lsq_fake_quantize(x, scale, 3, g), yb.detach(), rtol=1e-6, atol=0)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-6, atol=0)
    assert torch.equal(xa.grad == 0, xb.grad == 0)  # the same elements are clamped
    # the step's gradient sums 16 terms: float32 reordering, ~1e-6 relative to their size
    assert torch.allclose(sa.grad, sb.grad, rtol=1e-5, atol=1e-6 * float(sb.grad.abs().max()))


def test_boundary_is_inside_beyond_is_clamped():
    s = torch.tensor([[0.25]])
    x = torch.tensor([[0.75, -0.75, 0.75, -0.75, 0.1, 0.0, 0.3, 0.6]])  # +-Q s with Q = 3
    x[0, 2] = torch.nextafter(torch.tensor(0.75), torch.tensor(1.0))  # just beyond
    x[0, 3] = torch.nextafter(torch.tensor(-0.75), torch.tensor(-1.0))
    xg, sg = x.clone().requires_grad_(True), s.clone().requires_grad_(True)
    y = lsq_fake_quantize(xg, sg, 3, 1.0)
    y.backward(torch.ones_like(x))
    assert xg.grad[0].tolist() == [1, 1, 0, 0, 1, 1, 1, 1]
    u = (x / 0.25)[0]
    # ends: round(u) - u = 0; beyond: +Q, -Q; inside: round(u) - u
    expect = 0 + 0 + 3 - 3 + sum(float(torch.round(v) - v) for v in u[4:])
    assert sg.grad.item() == pytest.approx(expect, abs=1e-6)


def test_finite_differences_where_the_derivative_exists():
    """For a clamped element y = +-Q s: dy/ds = +-Q exactly, dy/dx = 0 - what LSQ gives.
    Inside, y = round(x / s) s is a staircase in x (true derivative 0, LSQ says 1) and
    dy/ds = round(u) a.e. (true), while LSQ says round(u) - u: its -u is the STE's part."""
    x = torch.tensor([[1.9, -2.3, 0.37, -0.81]])  # Q = 3, s = 0.5: two clamped, two inside
    s = torch.tensor([[0.5]])
    xg, sg = x.clone().requires_grad_(True), s.clone().requires_grad_(True)
    lsq_fake_quantize(xg, sg, 3, 1.0).backward(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    h = 1e-3
    f = lambda xx, ss: lsq_fake_quantize(xx, ss, 3, 1.0)  # noqa: E731
    fd_s = (f(x, s + h) - f(x, s - h)) / (2 * h)  # d y_i / d s for each element
    assert fd_s[0, 0].item() == pytest.approx(3.0, rel=1e-3) and sg.grad.item() == 3.0
    u = x / s
    assert fd_s[0, 2].item() == pytest.approx(float(torch.round(u[0, 2])), abs=1e-3)
    sg2 = s.clone().requires_grad_(True)
    lsq_fake_quantize(x, sg2, 3, 1.0).backward(torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    assert sg2.grad.item() == pytest.approx(fd_s[0, 2].item() - u[0, 2].item(), abs=1e-3)
    xp, xm = x.clone(), x.clone()
    xp[0, 0] += h
    xm[0, 0] -= h
    assert (f(xp, s) - f(xm, s))[0, 0].item() == 0.0 and xg.grad[0, 0].item() == 0.0


def test_grad_scale_and_zero_scale():
    assert lsq_grad_scale(64, 7) == 1 / math.sqrt(448)
    x = torch.zeros(1, 8, requires_grad=True)
    s = torch.zeros(1, 1, requires_grad=True)
    y = lsq_fake_quantize(x, s, 4, 0.5)
    y.sum().backward()
    assert torch.equal(y.detach(), torch.zeros(1, 8)) and bool(torch.isfinite(s.grad).all())
    assert torch.equal(x.grad, torch.ones(1, 8))


def test_weight_quantizer_starts_at_qlab_and_stores_fp16_steps():
    w = torch.randn(16, 128) * 0.02
    q = LSQQuantizer("int3", 64, init=w)
    assert torch.equal(q(w), qlab.fake_quantize(w, "int3", 64))
    qt = q.quantize(w)
    ref = qlab.quantize(w, "int3", 64)
    assert torch.equal(qt.codes, ref.codes) and torch.equal(qt.scales, ref.scales)
    assert q.n_per_scale(w) == 64
    with torch.no_grad():
        q.scale.mul_(1.003)  # not an fp16 value any more: the forward uses the fp16 one
    assert torch.equal(q.quantize(w).scales, q.scale.detach().half())
    assert not torch.equal(q.quantize(w).scales, ref.scales)
    assert torch.equal(q(w).detach(), q.quantize(w).dequantize())  # what convert would store
    assert q.quantize(w).scales.dtype == torch.float16
    q(w).sum().backward()
    assert q.scale.grad is not None and bool((q.scale.grad != 0).any())  # straight through


def test_activation_quantizer_starts_from_its_first_batch():
    q = LSQQuantizer("int4")
    x = torch.randn(3, 10, 32)
    with pytest.raises(RuntimeError, match="has not seen a batch"):
        q.quantize(x)
    q(x)
    assert q.scale.item() == pytest.approx(2 * x.abs().mean().item() / math.sqrt(7))
    assert q.n_per_scale(x) == 320  # the features of one example (the paper's N_F)
    first = q.scale.item()
    q(x * 10)
    assert q.scale.item() == first  # set once


def test_a_learned_step_beats_absmax_on_its_objective():
    """int2 on Gaussian weights: the absmax step (s = max|w|) zeroes most weights; training
    the step by LSQ's gradient on the reconstruction error finds a smaller, better one."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    q = LSQQuantizer("int2", "channel", init=w)
    err0 = ((q(w) - w) ** 2).mean().item()
    opt = torch.optim.Adam(q.parameters(), lr=0.02)
    for _ in range(100):
        opt.zero_grad()
        ((q(w) - w) ** 2).mean().backward()
        opt.step()
    err = ((q(w) - w) ** 2).mean().item()
    assert err < 0.6 * err0, (err0, err)
    assert float(q.scale.detach().mean()) < 0.5 * float(w.abs().amax(-1).mean())


def test_refuses_non_integer_schemes():
    with pytest.raises(ValueError, match="symmetric integer grid"):
        LSQQuantizer("nf4", 64, init=torch.randn(4, 64))
    with pytest.raises(ValueError, match="symmetric integer grid"):
        LSQQuantizer("int4_asym", "channel", init=torch.randn(4, 64))
