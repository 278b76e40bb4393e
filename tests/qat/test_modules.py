"""prepare_qat / convert: before training, convert(prepare_qat(m)) IS qlab's PTQ of m (bit for
bit, through qlab.lm.quality's own evaluation); after training, the converted model computes
what the QAT model computed; a short QAT run lowers the loss of the quantized model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qlab
from qlab.lm import quality as Q
from qlab.lm.model import TinyLM, TinyLMConfig
from qlab.qat import LSQQuantizer, QATLinear, QuantLinear, convert, prepare_qat
from qlab.qat.train import Recipe, train_qat

CONFIGS = [  # (weights, granularity, acts, learned weight steps)
    ("int4", "channel", None, None),
    ("int3", 64, None, None),
    ("int2", 64, None, None),
    ("int4", 64, "int4", None),
    ("int4", 64, None, False),  # dynamic absmax scale, straight through
    ("nf4", 64, None, None),
    ("mxfp4", None, "fp8_e4m3", None),
]


@pytest.fixture(scope="module")
def base():
    return Q.load_model()


@pytest.fixture(scope="module")
def windows():
    return Q.validation_windows(2, 64)  # equality is bit for bit: a short window will do


def _ptq(model, weights, gran, acts):
    q = Q.quantize_weights(model, weights, gran)
    return q if acts is None else Q.quantize_activations(q, acts, "token")


@pytest.mark.parametrize("weights,gran,acts,learn", CONFIGS)
def test_convert_of_untrained_prepare_is_plain_ptq(base, windows, weights, gran, acts, learn):
    qat = prepare_qat(base, weights, gran, act_scheme=acts, learn_weight_scales=learn)
    converted = convert(qat)
    ptq = _ptq(base, weights, gran, acts)
    assert torch.equal(Q.logits(converted, windows), Q.logits(ptq, windows))
    assert torch.equal(Q.logits(qat, windows), Q.logits(ptq, windows))
    for name, lin in converted.linear_layers().items():
        assert isinstance(lin, QuantLinear)
        ref = qlab.quantize(base.get_submodule(name).weight, weights, gran)
        assert torch.equal(lin.qweight.codes, ref.codes) and torch.equal(lin.qweight.scales,
                                                                         ref.scales)
        assert torch.equal(lin.weight, ref.dequantize())
    for p, q in zip(base.parameters(), Q.load_model().parameters(), strict=True):
        assert torch.equal(p, q)  # prepare_qat copied: the input model is untouched


def test_learned_steps_are_lsq_and_dynamic_otherwise(base):
    lin = prepare_qat(base, "int3", 64).blocks[0].mlp.fc1
    assert isinstance(lin, QATLinear) and isinstance(lin.weight_quantizer, LSQQuantizer)
    assert lin.weight_quantizer.scale.shape == (768, 3)
    assert not any(isinstance(m, LSQQuantizer) for m in prepare_qat(base, "nf4", 64).modules())
    with pytest.raises(ValueError, match="symmetric integer"):
        prepare_qat(base, "nf4", 64, learn_weight_scales=True)
    with pytest.raises(ValueError, match="act_granularity"):
        prepare_qat(base, "int4", 64, act_scheme="int4", act_granularity="channel")


def test_trained_qat_model_and_its_conversion_compute_the_same(base, windows):
    recipe = Recipe(weights="int3", acts="int8", steps=3, batch_size=4, block_size=64)
    qat, _, _ = train_qat(recipe, base=base, progress=False)
    converted = convert(qat)
    assert torch.equal(Q.logits(qat, windows), Q.logits(converted, windows))
    lin = converted.blocks[1].attn.proj
    assert lin.qweight.scales.dtype == torch.float16 and lin.qweight.codes.abs().max() <= 3
    assert not torch.equal(lin.qweight.scales, qlab.quantize(
        base.blocks[1].attn.proj.weight, "int3", 64).scales)  # the steps moved


def test_a_short_qat_run_lowers_the_loss_of_the_quantized_model(base):
    """int2 weights in groups of 64: PTQ roughly triples the perplexity of this model. Twenty
    small steps of QAT (8 x 128 bytes each) already take back a clear part of the loss; the
    validation windows were never trained on."""
    val = Q.validation_windows(4, 256)
    ref = Q.logits(base, val)
    before = Q.compare(ref, Q.logits(convert(prepare_qat(base, "int2", 64)), val), val)
    recipe = Recipe(weights="int2", steps=20, batch_size=8, block_size=128)
    trained = convert(train_qat(recipe, base=base, progress=False)[0])
    after = Q.compare(ref, Q.logits(trained, val), val)
    assert after.ppl < 0.85 * before.ppl and after.kl < 0.8 * before.kl, (before, after)


def test_any_model_of_linears():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    qat = prepare_qat(mlp, "int4", 16, act_scheme="int8", act_granularity="tensor")
    x = torch.randn(5, 32)
    manual = F.linear(qlab.fake_quantize(F.gelu(F.linear(qlab.fake_quantize(x, "int8", "tensor"),
                                                         qlab.fake_quantize(mlp[0].weight,
                                                                            "int4", 16),
                                                         mlp[0].bias)), "int8", "tensor"),
                      qlab.fake_quantize(mlp[2].weight, "int4", 16), mlp[2].bias)
    assert torch.equal(qat(x), manual)
    assert torch.equal(convert(qat)(x), manual)
    with pytest.raises(ValueError, match="no nn.Linear"):
        prepare_qat(nn.GELU(), "int4")
    with pytest.raises(ValueError, match="bare nn.Linear"):
        prepare_qat(nn.Linear(16, 4), "int4", 16)
    with pytest.raises(ValueError, match="no QATLinear"):
        convert(mlp)


def test_lsq_activation_steps_are_set_by_the_first_batch():
    model = TinyLM(TinyLMConfig(block_size=32, n_layer=1, n_head=2, d_model=64))
    qat = prepare_qat(model, "int4", 32, act_scheme="int4", act_granularity="lsq")
    with pytest.raises(RuntimeError, match="has not seen a batch"):
        convert(qat)
    x = torch.randint(0, 256, (2, 16))
    y = qat(x)
    converted = convert(qat)
    assert torch.equal(converted(x), y.detach())
    assert float(converted.blocks[0].mlp.fc2.input_quantizer.scale.detach()) > 0
