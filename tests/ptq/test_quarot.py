"""QuaRot's exact transformations (qlab.ptq.quarot) on the shipped TinyLM: LayerNorm folding
and the randomized Hadamard leave the logits unchanged, with and without the KV cache; and
quarot_quantize, the whole pipeline (rotate, GPTQ or RTN weights, int4 inputs, KV cache)."""

import pytest
import torch
from torch import nn

import qlab
import qlab.kv
from qlab.lm import outliers
from qlab.lm import quality as Q
from qlab.ptq import calibrate, quarot
from qlab.ptq.calibrate import calibration_windows, capture_inputs
from qlab.ptq.gptq import hessian
from qlab.ptq.quarot import (
    fold_layernorms,
    is_folded,
    quarot_quantize,
    randomized_hadamard,
    rotate,
    token_kurtosis,
)

# float64: both transformations are identities in real arithmetic; measured max |diff| of
# the logits (|logits| <= 23.5) 8.7e-14 (fold) and 1.5e-13 (fold + rotate), i.e. float64
# rounding (ulp(23) = 3.6e-15) over 4 layers. 1e-10 leaves ~700x headroom; a missing
# centring moves the logits by > 1e-3 of max |logits| (test_centring_is_needed).
ATOL_F64 = 1e-10
# float32: the transformed models round differently from the original. Measured on these
# 8 windows: max |diff| 7.0e-5 (fold), 8.2e-5 (rotate vs fold), 5.3e-5 (rotate vs original),
# while the float32 original itself is 5.7e-5 from its float64 evaluation: the differences
# are float32 rounding of the original's own size. Bound: 1e-5 of max |logits| (2.3e-4).
RTOL_F32 = 1e-5


@pytest.fixture(scope="module")
def model():
    return Q.load_model()


@pytest.fixture(scope="module")
def windows():
    return Q.validation_windows(8, 256)


@pytest.fixture(scope="module")
def folded(model):
    return fold_layernorms(model)


@pytest.fixture(scope="module")
def rotated(folded):
    return rotate(folded, seed=0)


def _close(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - b| / max |ref|"""
    return float((a - b).abs().max() / ref.abs().max())


def test_fold_structure(model, folded):
    assert not any(isinstance(m, nn.LayerNorm) for m in folded.modules())
    assert is_folded(folded) and not is_folded(model)
    assert folded.head.weight.data_ptr() != folded.tok_emb.weight.data_ptr()  # untied
    assert folded.blocks[0].attn.qkv.bias is not None and folded.blocks[0].mlp.fc1.bias is not None
    # the residual stream is centred: every write has zero mean over the channels
    assert folded.tok_emb.weight.mean(-1).abs().max() < 1e-7
    assert folded.blocks[2].mlp.fc2.weight.mean(0).abs().max() < 1e-7
    assert sorted(folded.linear_layers()) == sorted(model.linear_layers())  # head not in it
    assert isinstance(model.blocks[0].ln1, nn.LayerNorm)  # the input is left alone


def test_fold_and_rotate_exact_in_float64(windows):
    m64 = Q.load_model().double()  # a fresh copy: nn.Module.double() works in place
    f64 = fold_layernorms(m64)
    r64 = rotate(f64, seed=3)
    ref = Q.logits(m64, windows)
    assert (Q.logits(f64, windows) - ref).abs().max() < ATOL_F64
    assert (Q.logits(r64, windows) - ref).abs().max() < ATOL_F64


def test_fold_keeps_logits_float32(model, folded, windows):
    ref = Q.logits(model, windows)
    assert _close(Q.logits(folded, windows), ref, ref) < RTOL_F32


def test_rotate_keeps_logits_float32(model, folded, rotated, windows):
    ref, lf = Q.logits(model, windows), Q.logits(folded, windows)
    lr = Q.logits(rotated, windows)
    assert _close(lr, lf, ref) < RTOL_F32
    assert _close(lr, ref, ref) < RTOL_F32


def _decode(model, idx, prefill):
    cache = model.new_cache()
    out = [model(idx[:, :prefill], cache)]
    for t in range(prefill, idx.shape[1]):
        out.append(model(idx[:, t:t + 1], cache))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("which", ["folded", "rotated"])
def test_kv_cache_decode_and_generate(model, folded, rotated, windows, which):
    m = folded if which == "folded" else rotated
    idx = windows[:2, :96]
    with torch.no_grad():
        ref = model(idx)
        dec = _decode(m, idx, prefill=40)
    assert _close(dec, ref, ref) < RTOL_F32
    prompt = windows[:2, :64]
    assert torch.equal(m.generate(prompt, 32), model.generate(prompt, 32))


def test_centring_is_needed(model, windows, monkeypatch):
    """The SliceGPT centring is what makes LayerNorm = RMS norm: without it the logits move."""
    monkeypatch.setattr(quarot, "_centre_rows", lambda w: w)
    monkeypatch.setattr(quarot, "_centre_outputs", lambda w: w)
    ref = Q.logits(model, windows[:2])
    assert _close(Q.logits(fold_layernorms(model), windows[:2]), ref, ref) > 1e-3


def test_rotated_weights_are_the_rotation(folded, rotated):
    q = randomized_hadamard(192, 0)
    # float32: a sum of 192 rounded products; bound 192 ulps of 1 (measured 1.5e-6)
    assert (q @ q.T - torch.eye(192)).abs().max() < 192 * 2**-23
    q64 = randomized_hadamard(192, 0, torch.float64)
    assert (q64 @ q64.T - torch.eye(192, dtype=torch.float64)).abs().max() < 1e-14
    torch.testing.assert_close(rotated.tok_emb.weight, folded.tok_emb.weight @ q)
    torch.testing.assert_close(rotated.blocks[1].attn.qkv.weight,
                               folded.blocks[1].attn.qkv.weight @ q)
    torch.testing.assert_close(rotated.blocks[1].attn.proj.weight,
                               q.T @ folded.blocks[1].attn.proj.weight)
    # the rotation changes every weight it touches (not a no-op)
    for name in ("tok_emb.weight", "head.weight", "blocks.0.attn.qkv.weight",
                 "blocks.0.mlp.fc2.weight"):
        before, after = folded.get_parameter(name), rotated.get_parameter(name)
        assert (after - before).abs().max() > 0.1 * before.abs().max(), name
    assert rotated.blocks[0].mlp.hidden_transform is not None
    assert folded.blocks[0].mlp.hidden_transform is None  # the input is left alone


def test_randomized_hadamard_seeds():
    a, b = randomized_hadamard(192, 0), randomized_hadamard(192, 1)
    assert torch.equal(a, randomized_hadamard(192, 0))
    assert not torch.equal(a, b)
    assert torch.equal(a.abs(), b.abs())  # only signs differ ...
    assert torch.equal(a * b, (a * b)[:, :1].expand_as(a))  # ... whole rows: a * b constant per row


def test_refuses_wrong_input(model, folded, rotated):
    with pytest.raises(ValueError, match="fold_layernorms"):
        rotate(model, 0)
    with pytest.raises(ValueError, match="already folded"):
        fold_layernorms(folded)
    with pytest.raises(ValueError, match="already rotated"):
        rotate(rotated, 1)


def _inputs(model, windows, linear: str) -> list[torch.Tensor]:
    """The input of blocks.i.<linear> for every block, (tokens, K)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [b.get_submodule(linear).register_forward_pre_hook(
        lambda _m, a, i=i: seen.__setitem__(i, a[0].flatten(0, -2)))
        for i, b in enumerate(model.blocks)]
    Q.logits(model, windows)
    for h in hooks:
        h.remove()
    return [seen[i] for i in range(len(model.blocks))]


def test_rotation_flattens_activations(model, folded, rotated, windows):
    """Per-token kurtosis. Measured (layers 0..3), qkv input: original 2.85 3.12 3.18 3.26,
    folded 2.81 3.06 3.25 3.36, rotated (seed 0) 2.95 3.01 2.98 2.98: TinyLM's attention
    input is already near Gaussian (3) and the rotation brings it closer. fc2 input:
    original 17.9 34.0 45.1 27.6 (outlier channels), rotated 3.4 4.9 5.2 5.3."""
    k = {name: [token_kurtosis(x) for x in _inputs(m, windows, "attn.qkv")]
         for name, m in (("orig", model), ("folded", folded), ("rot", rotated))}
    assert max(k["rot"]) < min(max(k["orig"]), max(k["folded"]))
    dist = {name: sum(abs(v - 3) for v in ks) for name, ks in k.items()}
    assert dist["rot"] < min(dist["orig"], dist["folded"])
    k_fc2 = [token_kurtosis(x) for x in _inputs(model, windows, "mlp.fc2")]
    k_fc2_rot = [token_kurtosis(x) for x in _inputs(rotated, windows, "mlp.fc2")]
    assert all(r < o / 3 for r, o in zip(k_fc2_rot, k_fc2, strict=True)), (k_fc2, k_fc2_rot)


# --------------------------------------------------------------------------- quarot_quantize


def test_quarot_quantize_without_quantizers_is_the_float_model(model, windows):
    """Nothing quantized: rotate=False is a plain copy (bit-identical logits); rotated, the
    logits move by float32 rounding only (RTOL_F32, as test_rotate_keeps_logits_float32);
    so does the key/query Hadamard of qlab.kv's "hadamard" (measured 4.2e-6)."""
    ref = Q.logits(model, windows)
    plain = quarot_quantize(model, rotate=False, weights=None, acts=None)
    assert torch.equal(Q.logits(plain, windows), ref)
    for kv in (None, "hadamard"):
        q = quarot_quantize(model, weights=None, acts=None, kv=kv)
        assert q.blocks[0].mlp.hidden_transform is not None  # rotated, not a copy
        assert _close(Q.logits(q, windows), ref, ref) < RTOL_F32, kv
    assert isinstance(model.blocks[0].ln1, nn.LayerNorm)  # the input is left alone


def test_unrotated_rtn_is_chapter_12_w4a4(model, windows):
    """rotate=False, RTN: per-channel int4 weights and per-token int4 inputs, exactly the
    "W4A4 per-token" recipe of chapter 12 (qlab.lm.outliers): the same logits, bit for bit."""
    ours = Q.logits(quarot_quantize(model, rotate=False, method="rtn"), windows[:4])
    ch12 = outliers.quantize_model(model, outliers.Recipe(weights="int4", acts="int4"))
    assert torch.equal(ours, Q.logits(ch12, windows[:4]))


def test_rtn_quantizes_the_rotated_weights_then_inputs_then_cache(model, rotated, windows):
    q = quarot_quantize(model, method="rtn", acts="int4", kv="int4")
    for name, lin in q.linear_layers().items():  # per output channel, of the ROTATED weight
        expected = qlab.fake_quantize(rotated.get_submodule(name).weight, "int4", "channel")
        assert torch.equal(lin.weight, expected), name
    assert len(q.activation_quantizers) == len(q.linear_layers())  # one input quantizer each
    # kv= is qlab.kv.quantize_cache on the W4A4 model, nothing else
    w4a4 = quarot_quantize(model, method="rtn", acts="int4")
    assert torch.equal(Q.logits(q, windows[:2]),
                       Q.logits(qlab.kv.quantize_cache(w4a4, "int4"), windows[:2]))


def test_w4a4kv4_full_forward_is_decoding(model, windows):
    """Per-token inputs and the per-token int4 cache ("hadamard_int4": no full-precision
    window) depend on each token alone, so the full forward that chapter 16 measures gives
    what decoding one token at a time gives (qlab.kv's docstring). Measured max |diff|
    1.3e-5 (|logits| <= 22.4): float32 rounding; bound 1e-3 of max |logits|."""
    q = quarot_quantize(model, method="rtn", kv="hadamard_int4")
    w = windows[:2, :65]
    full = Q.logits(q, w)
    assert _close(qlab.kv.decode_logits(q, w), full, full) < 1e-3


class _Recorded(Exception):
    pass


def test_gptq_is_fed_the_rotated_model(model, folded, rotated, monkeypatch):
    """The first layer GPTQ calibrates (blocks.0.attn.qkv, before any layer is quantized)
    gets the rotated weight W Q and the Hessian of the rotated inputs, Q^T H Q with H the
    folded model's: x -> x Q, float activations (the input quantizers come after GPTQ, as
    in QuaRot's main.py). float32 Hessians of rounded inputs: measured max relative
    difference 4.8e-7, bound 1e-5; the unrotated H differs by ~1 (relative)."""
    calib = calibration_windows(2, 64)
    seen = {}

    def record(weight, h, *args, **kwargs):
        seen["w"], seen["h"], seen["scheme_group"] = weight, h, args[:2]
        raise _Recorded  # one layer is enough

    monkeypatch.setattr(calibrate, "gptq", record)
    with pytest.raises(_Recorded):
        quarot_quantize(model, weights="int4", acts="int4", kv="int4", calib=calib)
    assert torch.equal(seen["w"], rotated.blocks[0].attn.qkv.weight)
    assert seen["scheme_group"] == ("int4", None)  # one scale per output channel
    q = randomized_hadamard(192, 0, torch.float64)
    h_fold = hessian(capture_inputs(folded, "blocks.0.attn.qkv", calib)).double()
    h_rot = seen["h"].double()
    assert _close(q.T @ h_fold @ q, h_rot, h_rot) < 1e-5
    assert _close(h_fold, h_rot, h_rot) > 0.1  # the check can tell rotated from not


def test_rotation_lowers_w4a4_error(model, windows):
    """The rotation is what makes W4A4 work (QuaRot's premise), measured with RTN on 4
    windows: KL 0.43 unrotated, 0.16 rotated (16 windows, chapter 16); bound: half."""
    ref = Q.logits(model, windows[:4])
    kl = {rot: Q.kl_per_token(ref, Q.logits(quarot_quantize(model, rotate=rot, method="rtn"),
                                            windows[:4])).mean().item()
          for rot in (False, True)}
    assert kl[True] < kl[False] / 2, kl


@pytest.mark.parametrize("kwargs, error, match", [
    ({"method": "awq"}, ValueError, "method must be one of"),
    ({"weights": "int9x"}, ValueError, "unknown scheme"),
    ({"acts": "fp5"}, ValueError, "unknown scheme"),
    ({"weights": "nvfp4"}, ValueError, "GPTQ takes integer"),
    ({"kv": "int5"}, ValueError, "unknown KV-cache scheme"),
])
def test_quarot_quantize_refuses_bad_arguments(model, monkeypatch, kwargs, error, match):
    monkeypatch.setattr(calibrate, "gptq", None)  # refused before any calibration starts
    with pytest.raises(error, match=match):
        quarot_quantize(model, **kwargs)


def test_quarot_quantize_refuses_wrong_models(folded):
    with pytest.raises(ValueError, match="already folded"):
        quarot_quantize(folded, method="rtn")
    with pytest.raises(TypeError, match="takes a TinyLM"):
        quarot_quantize(nn.Linear(4, 4))
