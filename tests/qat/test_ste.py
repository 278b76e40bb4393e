"""fake_quantize_ste: forward bit-identical to qlab.fake_quantize for every scheme; backward
= the stated STE convention (passes inside the closed range of the grid, 0 where clamped),
checked against torch's own clamp autograd, at the boundary, and by finite differences
where the true derivative exists."""

import pytest
import torch

import qlab
from qlab.qat import fake_quantize_ste, representable_range

SCHEMES = [*qlab.SCHEME_NAMES, "int2", "int3", "int3_asym", "uint2_asym"]


def _granularities(name: str):
    sch = qlab.get_scheme(name)
    if sch.block is not None:
        return [None]
    return ["tensor", "channel", 16] if sch.scale_rule != "nf4" else [16, 64]


def _x(seed: int, shape=(6, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3
    x[1, :16] = 0.0  # an all-zero group
    x[2] *= -1  # negative-heavy rows for the asymmetric schemes
    x[3, 5] = 40.0  # an outlier that sets a large scale
    return x


@pytest.mark.parametrize("name", SCHEMES)
def test_forward_is_bit_identical_to_fake_quantize(name):
    for gran in _granularities(name):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = _x(1).to(dtype)
            want = qlab.fake_quantize(x, name, gran)
            got = fake_quantize_ste(x.clone().requires_grad_(True), name, gran)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got.detach(), want), (name, gran, dtype)
            assert torch.equal(torch.signbit(got.detach()), torch.signbit(want))


@pytest.mark.parametrize("name", SCHEMES)
def test_backward_passes_inside_and_blocks_where_clamped(name):
    """The gradient is dL/dy where x lies within its group's range and exactly 0 elsewhere;
    where it is 0, the output is an end of the range (the value was clamped)."""
    for gran in _granularities(name):
        x = _x(2).requires_grad_(True)
        grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
        y = fake_quantize_ste(x, name, gran)
        y.backward(grad_y)
        lo, hi = representable_range(qlab.quantize(x.detach(), name, gran))
        xd = x.detach()
        inside = (xd >= lo) & (xd <= hi)
        assert torch.equal(x.grad, torch.where(inside, grad_y, 0.0)), (name, gran)
        assert bool(((y.detach() == lo) | (y.detach() == hi))[~inside].all()), (name, gran)
        assert bool(((y.detach() >= lo) & (y.detach() <= hi)).all()), (name, gran)


def _independent_range(x: torch.Tensor, name: str):
    """The ends of each element's grid, from the scale rules written out by hand, per group
    of 32 (int4 / int3_asym / fp8_e4m3 / mxfp4) or per 16 (nvfp4)."""
    g = 16 if name == "nvfp4" else 32
    b = x.reshape(x.shape[0], -1, g)  # shape: (R, G, g)
    amax = b.abs().amax(dim=-1, keepdim=True)
    if name == "int4":
        s = (amax / 7).half().float()
        lo, hi = -7 * s, 7 * s
    elif name == "int3_asym":
        mn, mx = b.amin(-1, keepdim=True).clamp(max=0), b.amax(-1, keepdim=True).clamp(min=0)
        s = ((mx - mn) / 7).half().float()
        z = torch.clamp(torch.round(-mn / torch.where(s == 0, 1.0, s)), 0, 7)
        lo, hi = (0 - z) * s, (7 - z) * s
    elif name == "fp8_e4m3":
        s = amax / 448
        lo, hi = -448 * s, 448 * s
    elif name == "mxfp4":
        _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
        scale = torch.ldexp(torch.ones_like(amax), (e - 1 - 2).clamp(-127, 127))
        lo, hi = -6 * scale, 6 * scale
    else:  # nvfp4
        ts = x.abs().max() / 2688
        bs = ((amax / 6) / ts).clamp(2.0**-6, 448).to(torch.float8_e4m3fn).float()
        lo, hi = -6 * (ts * bs), 6 * (ts * bs)
    expand = lambda t: t.expand_as(b).reshape(x.shape)  # noqa: E731
    return expand(lo), expand(hi)


@pytest.mark.parametrize("name", ["int4", "int3_asym", "fp8_e4m3", "mxfp4", "nvfp4"])
def test_gradient_equals_torch_clamp_autograd(name):
    """Independent check: torch's autograd of clamp(x, lo, hi), with lo / hi from the scale
    rule written out here, passes the gradient exactly where ours does, ends included."""
    x = _x(4)
    x[0, :32] = torch.linspace(-15, 15, 32)  # MXFP4: amax 15 -> X = 2: |x| > 12 saturates
    gran = 32 if name in ("int4", "int3_asym", "fp8_e4m3") else None
    lo, hi = _independent_range(x, name)
    xc = x.clone().requires_grad_(True)
    torch.clamp(xc, lo, hi).sum().backward()
    xg = x.clone().requires_grad_(True)
    fake_quantize_ste(xg, name, gran).sum().backward()
    assert torch.equal(xg.grad, xc.grad), name
    if name in ("int3_asym", "mxfp4"):
        assert bool((xg.grad == 0).any()), "this input does clamp somewhere"


def _group(amax: float, qmax: int = 7) -> torch.Tensor:
    x = torch.linspace(-0.5, 0.5, 16) * amax
    x[3] = amax
    return x


def test_boundary_exact_rounded_down_and_rounded_up_fp16_scale():
    s = 1000 * 2.0**-16  # exactly representable in fp16
    exact = torch.tensor(7 * s)  # amax / 7 == s exactly: u == 7, at the end of the grid
    down = torch.tensor(7 * s * (1 + 2.0**-13))  # fp16(amax / 7) rounds down to s: u > 7
    up = torch.tensor(7 * s * (1 - 2.0**-13))  # rounds up to s: u < 7
    x = torch.stack([_group(float(a)) for a in (exact, down, up)]).requires_grad_(True)
    fake_quantize_ste(x, "int4", 16).backward(torch.ones(3, 16))
    qt = qlab.quantize(x.detach(), "int4", 16)
    assert torch.equal(qt.scales.float(), torch.full((3, 1), s))
    u = x.detach()[:, 3] / s
    assert u[0] == 7 and u[1] > 7 and u[2] < 7
    assert x.grad[:, 3].tolist() == [1.0, 0.0, 1.0]  # at the end: passes; beyond: 0
    assert bool((x.grad[:, torch.arange(16) != 3] == 1).all())
    # negative side, same rule
    xn = (-x.detach()).requires_grad_(True)
    fake_quantize_ste(xn, "int4", 16).backward(torch.ones(3, 16))
    assert xn.grad[:, 3].tolist() == [1.0, 0.0, 1.0]


def test_all_zero_group_passes_the_gradient():
    x = torch.zeros(2, 32)
    x[1] = torch.randn(32)
    x.requires_grad_(True)
    y = fake_quantize_ste(x, "int4", 16)
    y.backward(torch.full((2, 32), 2.0))
    assert torch.equal(y[0].detach(), torch.zeros(32))
    assert torch.equal(x.grad[0], torch.full((32,), 2.0))


def test_asymmetric_clamps_at_both_ends():
    # zero point rounding leaves min or max up to half a step outside [(0 - z) s, (15 - z) s]
    x = torch.tensor([[-1.0, -0.2, 0.1, 0.35, 2.03]]).repeat(1, 2)
    xg = x.clone().requires_grad_(True)
    y = fake_quantize_ste(xg, "int4_asym", "channel")
    y.sum().backward()
    qt = qlab.quantize(x, "int4_asym", "channel")
    s, z = float(qt.scales.float()), float(qt.zero_points.float())
    lo, hi = (0 - z) * s, (15 - z) * s
    want = ((x >= lo) & (x <= hi)).float()
    assert torch.equal(xg.grad, want)
    assert bool((xg.grad == 0).any()), (lo, hi)  # this input does clamp one end


def test_finite_differences_where_the_derivative_exists():
    """MXFP4 saturates |x / X| in (6, 8) to 6. For such an element that is not its block's
    absmax, small moves change neither the scale nor the output: the true derivative is 0,
    and so is the STE's. Inside the grid the true derivative is 0 almost everywhere (a
    staircase) while the STE says 1: that is the convention, checked above, not a
    derivative."""
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(5)) * 0.1
    x[0, 0] = 7.5  # absmax: X = 2^(2 - 2) = 1, so the grid reaches 6
    x[0, 1] = 7.0  # saturated (|u| = 7 > 6), not the absmax
    x[0, 2] = -6.5  # saturated on the negative side
    xg = x.clone().requires_grad_(True)
    weights = torch.randn(1, 32, generator=torch.Generator().manual_seed(6))
    (fake_quantize_ste(xg, "mxfp4") * weights).sum().backward()
    h = 1e-3
    for i in (1, 2):
        xp, xm = x.clone(), x.clone()
        xp[0, i] += h
        xm[0, i] -= h
        fd = ((qlab.fake_quantize(xp, "mxfp4") - qlab.fake_quantize(xm, "mxfp4")) * weights).sum()
        assert fd.item() == 0.0 and xg.grad[0, i].item() == 0.0
    assert xg.grad[0, 3].item() == weights[0, 3].item()  # inside: straight through


def test_runs_on_bf16_and_keeps_dtype_of_the_gradient():
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    y = fake_quantize_ste(x, "nvfp4")
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def test_refuses_non_float_and_bad_granularity():
    with pytest.raises(TypeError, match="floating-point"):
        fake_quantize_ste(torch.arange(8), "int4")
    with pytest.raises(ValueError, match="does not divide"):
        fake_quantize_ste(torch.randn(2, 24), "int4", 16)
