"""TinyLM shapes and the KV cache: decoding token by token equals one full forward."""

import pytest
import torch

from qlab.lm.model import TinyLM, TinyLMConfig
from qlab.lm.quality import load_model, quantize_kv_cache, validation_windows

# Decode and full forward run the same float32 operations on differently shaped
# matrices (a (1, S) attention row vs a (T, S) block; BLAS blocks the sums
# differently), so logits agree to float32 rounding, not bitwise. Logits here reach
# |22|; the measured max abs difference is 2.7e-5 (~1e-6 relative, a few fp32 ulps
# accumulated over 4 layers). 2e-4 leaves ~8x headroom for other BLAS builds and is
# far below any real bug: a causal mask built from the wrong cache length moved
# logits by 3.5 when this test caught it.
DECODE_ATOL = 2e-4


def test_shapes_and_size():
    cfg = TinyLMConfig()
    model = TinyLM(cfg)
    x = torch.randint(0, 256, (2, 17))
    assert model(x).shape == (2, 17, 256)
    assert 1_000_000 <= model.n_params() <= 5_000_000
    assert cfg.d_model % cfg.n_head == 0 and cfg.head_dim == 64
    assert sorted(model.linear_layers())[:4] == [
        "blocks.0.attn.proj", "blocks.0.attn.qkv", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2"]
    assert len(model.linear_layers()) == 4 * cfg.n_layer


def test_too_long_context_is_refused():
    model = TinyLM(TinyLMConfig(block_size=8, n_layer=1))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def _decode_all(model, idx, prefill):
    cache = model.new_cache()
    out = [model(idx[:, :prefill], cache)]
    for t in range(prefill, idx.shape[1]):
        out.append(model(idx[:, t:t + 1], cache))
    assert cache.length == idx.shape[1]
    return torch.cat(out, dim=1)


@torch.no_grad()
def test_kv_cache_decode_equals_full_forward():
    model = load_model()
    idx = validation_windows(2, 96)[:, :96]
    full = model(idx)
    for prefill in (1, 40):
        assert (full - _decode_all(model, idx, prefill)).abs().max() < DECODE_ATOL


@torch.no_grad()
def test_quantized_cache_decode_equals_quantized_full_forward():
    # Per-token KV quantization depends only on the token itself, so quantizing K/V in a
    # full forward is exactly what a quantized cache sees during decoding.
    model = quantize_kv_cache(load_model(), "int4")
    idx = validation_windows(2, 64)[:, :64]
    assert (model(idx) - _decode_all(model, idx, 8)).abs().max() < DECODE_ATOL
    # ...and it is not the unquantized model (the test would pass vacuously otherwise)
    assert (model(idx) - load_model()(idx)).abs().max() > 100 * DECODE_ATOL


@torch.no_grad()
def test_generate_uses_cache_consistently():
    model = load_model()
    prompt = validation_windows(1, 32)[:, :32]
    out = model.generate(prompt, 8)
    assert out.shape == (1, 40) and torch.equal(out[:, :32], prompt)
    # greedy continuation from the full forward gives the same next byte
    assert out[0, 32] == model(prompt)[0, -1].argmax()
