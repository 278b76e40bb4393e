"""QuaRot's exact transformations (qlab.ptq.quarot) on the shipped TinyLM: LayerNorm folding
and the randomized Hadamard leave the logits unchanged, with and without the KV cache."""

import pytest
import torch
from torch import nn

from qlab.lm import quality as Q
from qlab.ptq import quarot
from qlab.ptq.quarot import (
    fold_layernorms,
    is_folded,
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
