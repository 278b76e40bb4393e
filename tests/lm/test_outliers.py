"""qlab.lm.outliers: each recipe applies exactly the qlab function it names, to every layer."""

import pytest
import torch
from torch import nn

from qlab.lm import outliers
from qlab.lm import quality as Q
from qlab.lm.outliers import QuantLinear, Recipe, quantize_model
from qlab.pipelines import w8a8_reference
from qlab.ptq import hadamard, mixed_precision_matmul, random_rotation, smooth_scales
from qlab.quantize import fake_quantize


def _layer(k=192, n=96, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(3, 10, k, generator=g)  # 3 sequences of 10 tokens
    x[..., 7] *= 30.0  # an outlier channel
    return lin, x


def test_float_recipes_are_the_linear_layer():
    lin, x = _layer()
    amax = x.abs().flatten(0, 1).amax(0)
    ref = lin(x).detach().double()
    # no quantization at all: smoothing and rotations alone must not change the product
    for r in (Recipe(weights=None, acts=None),
              Recipe(weights=None, acts=None, smooth_alpha=0.5),
              Recipe(weights=None, acts=None, rotation="hadamard"),
              Recipe(weights=None, acts=None, rotation="random", seed=4),
              Recipe(weights=None, acts=None, rotation="random_hadamard", seed=4)):
        y = QuantLinear(lin, r, amax)(x)
        assert y.shape == (3, 10, 96)
        assert torch.allclose(y.double(), ref, rtol=0, atol=2e-4), r  # fp32 sums of 192 terms


def test_per_token_int8_is_the_w8a8_reference():
    lin, x = _layer(bias=False)
    y = QuantLinear(lin, Recipe(acts="int8", act_granularity="token"))(x)
    x2 = x.reshape(-1, 192)
    expected = w8a8_reference(x2, lin.weight.detach(), "int8", "channel", "token")
    # same codes and scales; fake-quant sums in fp32 vs exact integer sums: fp32 rounding
    assert torch.allclose(y.reshape(-1, 96), expected, rtol=1e-5, atol=1e-5)


def test_per_tensor_is_one_scale_per_sequence():
    lin, x = _layer(bias=False)
    x[1] *= 100.0  # a loud sequence must not coarsen the others' steps
    y = QuantLinear(lin, Recipe(weights=None, acts="int8", act_granularity="tensor"))(x)
    w = lin.weight.detach()
    expected = torch.stack([fake_quantize(x[s], "int8", "tensor") for s in range(3)]) @ w.T
    assert torch.equal(y, expected)  # the same batched matmul: bit for bit


def test_smoothing_rotation_and_block_formats_follow_their_definitions():
    lin, x = _layer(bias=False)
    w = lin.weight.detach()
    amax = x.abs().flatten(0, 1).amax(0)
    s = smooth_scales(amax, w.abs().amax(0), 0.75)
    y = QuantLinear(lin, Recipe(acts="int8", act_granularity="token", smooth_alpha=0.75),
                    amax)(x)
    expected = fake_quantize(x / s, "int8", "channel") @ fake_quantize(w * s, "int8", "channel").T
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)
    h = hadamard(192)
    y = QuantLinear(lin, Recipe(weights="int4", acts="int4", rotation="hadamard"))(x)
    expected = fake_quantize(x @ h, "int4", "channel") @ fake_quantize(w @ h, "int4", "channel").T
    assert torch.allclose(y, expected, rtol=1e-4, atol=1e-3)  # fwht vs x @ H: fp32 ulps, then
    # an occasional code flips at a rounding boundary: bounded by one int4 step
    q = random_rotation(192, 3)
    y = QuantLinear(lin, Recipe(acts="int8", rotation="random", seed=3))(x)
    expected = fake_quantize(x @ q, "int8", "channel") @ fake_quantize(w @ q, "int8", "channel").T
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)
    d = outliers.random_signs(192, 2)
    assert set(d.tolist()) == {-1.0, 1.0}  # both signs drawn
    dh = torch.diag(d) @ h  # QuaRot's randomized Hadamard D H
    y = QuantLinear(lin, Recipe(weights="int4", acts="int4", rotation="random_hadamard",
                                seed=2))(x)
    expected = fake_quantize(x @ dh, "int4", "channel") @ fake_quantize(w @ dh, "int4",
                                                                        "channel").T
    assert torch.allclose(y, expected, rtol=1e-4, atol=1e-3)  # as for H above
    assert not torch.equal(outliers.random_signs(192, 2), outliers.random_signs(192, 3))
    y = QuantLinear(lin, Recipe(weights="nvfp4", acts="nvfp4", act_granularity=None))(x)
    expected = fake_quantize(x.reshape(-1, 192), "nvfp4") @ fake_quantize(w, "nvfp4").T
    assert torch.allclose(y.reshape(-1, 96), expected, rtol=1e-5, atol=1e-5)


def test_llm_int8_recipe_and_the_columns_it_saw():
    lin, x = _layer()
    ql = QuantLinear(lin, Recipe(int8_threshold=6.0))
    y = ql(x)
    expected = mixed_precision_matmul(x, lin.weight.detach(), 6.0) + lin.bias.detach()
    assert torch.equal(y, expected)
    assert ql.outliers_seen.nonzero().flatten().tolist() == [7]


def test_quantize_model_swaps_every_linear_of_tinylm_and_matches_quality():
    lm = Q.load_model()
    windows = Q.validation_windows(2, 64)
    q = quantize_model(lm, Recipe(weights="int8", acts="int8", act_granularity="token"))
    assert not lm.linear_layers() == {} and q.linear_layers() == {}
    assert sum(isinstance(m, QuantLinear) for m in q.modules()) == 16
    # an independent path: qlab.lm.quality's hooks (per token = per row) + quantized weights
    other = Q.quantize_activations(Q.quantize_weights(lm, "int8", "channel"), "int8", "token")
    a, b = Q.logits(q, windows), Q.logits(other, windows)
    assert (a - b).abs().max() < 1e-3  # fp32 summation order only
    assert torch.equal(Q.logits(lm, windows), Q.logits(Q.load_model(), windows))  # untouched


def test_recipe_and_statistics_errors():
    with pytest.raises(ValueError, match="rotation"):
        Recipe(rotation="dct")
    with pytest.raises(ValueError, match="act_granularity"):
        Recipe(act_granularity="channel")
    lin, _ = _layer()
    with pytest.raises(ValueError, match="act_absmax"):
        QuantLinear(lin, Recipe(smooth_alpha=0.5))
    lm = Q.load_model()
    with pytest.raises(KeyError, match="no statistics"):
        quantize_model(lm, Recipe(smooth_alpha=0.5), {"blocks.0.attn.qkv": torch.ones(192)})


def test_bits_and_rotation_costs():
    lin, x = _layer()
    w, x2 = lin.weight.detach(), x.reshape(-1, 192)
    assert outliers.bits_per_element(Recipe(), w, x2) == (8 + 16 / 192, 8 + 16 / 192)
    assert outliers.bits_per_element(Recipe(act_granularity="tensor"), w, x2)[1] == 8.0
    assert outliers.bits_per_element(Recipe(weights="nvfp4", acts="nvfp4",
                                            act_granularity=None), w, x2) == (4.5, 4.5)
    assert outliers.bits_per_element(Recipe(weights=None, acts=None), w, x2) == (32.0, 32.0)
    wb, ab = outliers.bits_per_element(Recipe(int8_threshold=6.0), w, x2)
    frac = 1 / 192  # channel 7 only
    assert ab == pytest.approx((1 - frac) * (8 + 16 / 192) + 16 * frac)
    assert outliers.rotation_ops(384, "random") == 384 * 384
    assert outliers.rotation_ops(384, "hadamard") == 384 * 5 + 12 * 384  # 2^5 butterflies
    assert outliers.rotation_ops(256, "hadamard") == 256 * 8


def test_smoothquant_follows_the_reference_one_s_per_layernorm():
    from qlab.lm import minilm

    m = minilm.load()
    layers = m.linear_layers()
    g = torch.Generator().manual_seed(0)
    stats = {n: torch.rand(lin.in_features, generator=g) + 0.5 for n, lin in layers.items()}
    q = quantize_model(m, Recipe(weights=None, acts=None, smooth_alpha=0.5), stats)
    mods = dict(q.named_modules())
    p = "encoder.layer.3."
    qkv = [p + f"attention.self.{x}" for x in ("query", "key", "value")]
    w_absmax = torch.stack([layers[n].weight.detach().abs().amax(0) for n in qkv]).amax(0)
    expected = smooth_scales(stats[qkv[0]], w_absmax, 0.5)  # the max over q, k and v
    assert all(torch.equal(mods[n].smooth, expected) for n in qkv)
    fc1 = p + "intermediate.dense"
    assert torch.equal(mods[fc1].smooth,
                       smooth_scales(stats[fc1], layers[fc1].weight.detach().abs().amax(0), 0.5))
    for n in (p + "attention.output.dense", p + "output.dense"):  # no LayerNorm before them
        assert mods[n].smooth is None and mods[n].recipe.smooth_alpha is None
    lm = Q.load_model()
    lstats = {n: torch.ones(lin.in_features) for n, lin in lm.linear_layers().items()}
    qlm = dict(quantize_model(lm, Recipe(smooth_alpha=0.5), lstats).named_modules())
    assert [n for n, mod in qlm.items() if isinstance(mod, QuantLinear) and
            mod.smooth is not None] == [f"blocks.{i}.{k}" for i in range(len(lm.blocks))
                                        for k in ("attn.qkv", "mlp.fc1")]


def test_rotation_overhead_rotates_a_shared_input_once():
    from qlab.lm import minilm

    m = minilm.load()
    groups = outliers.input_groups(m.linear_layers())
    assert len(groups) == 6 * 4 and groups["encoder.layer.0.attention.self"] == [
        "encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key",
        "encoder.layer.0.attention.self.value"]
    macs = 6 * (4 * 384 * 384 + 2 * 384 * 1536)
    for rot in ("hadamard", "random"):
        ops = 6 * (3 * outliers.rotation_ops(384, rot) + outliers.rotation_ops(1536, rot))
        assert outliers.rotation_overhead(m, rot) == ops / macs
    assert round(100 * outliers.rotation_overhead(m, "hadamard"), 1) == 2.8
    assert round(100 * outliers.rotation_overhead(m, "random")) == 158
