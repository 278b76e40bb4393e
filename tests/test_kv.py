"""qlab.kv: KV-cache schemes against exact invariants and an independent formulation of
qlab's kivi rule."""

import math

import pytest
import torch

import qlab
from qlab import kv
from qlab.lm import quality
from qlab.ptq import fwht

# Reordered float32 sums on TinyLM's logits (|logit| up to ~22): tests/lm/test_model.py
# measures 2.7e-5 between decode and full forward and allows 2e-4. The Hadamard rotation
# is the same kind of difference (q k^T summed as (qH)(kH)^T, each fwht a few ulps of |x|,
# over 4 layers): measured 2.3e-5 here (OMP_NUM_THREADS=1), so the same 2e-4 bound.
LOGIT_ATOL = 2e-4
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def model():
    return quality.load_model()


@pytest.fixture(scope="module")
def windows():
    return quality.validation_windows(4, 128)


def _qkv(S=96, seed=0, B=2, H=3, D=64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
    k[..., 5] *= 20.0  # an outlier channel in the keys, as LLM keys have
    return q[:, :, -4:], k, v


def _transform(name, **kwargs):
    return kv.quantize_cache(quality.load_model(), name, **kwargs).blocks[0].attn.qkv_transform


def test_unknown_scheme_lists_valid_names(model):
    with pytest.raises(ValueError, match="unknown KV-cache scheme 'int3'") as err:
        kv.quantize_cache(model, "int3")
    assert all(name in str(err.value) for name in kv.KV_SCHEME_NAMES)


def test_per_channel_chunks_need_a_window():
    with pytest.raises(ValueError, match="window >= 32"):
        kv.KVScheme(name="bad", element="uint4_asym", key_axis="channel", window=0)


def test_input_model_untouched(model):
    kv.quantize_cache(model, "kivi2")
    assert all(b.attn.qkv_transform is None for b in model.blocks)


@torch.no_grad()
def test_hadamard_leaves_scores_and_logits_unchanged(model, windows):
    q, k, _ = _qkv()
    tq, tk, _ = _transform("hadamard")(q, k, k)
    assert torch.equal(tq, fwht(q)) and torch.equal(tk, fwht(k))
    # (qH)(kH)^T = q H H^T k^T = q k^T; each side a 64-term float32 dot product of
    # vectors off by a few ulps: bounded by 2 * 64 * eps * |q| |k| per score
    bound = 2 * 64 * EPS32 * q.norm(dim=-1)[..., None] * k.norm(dim=-1)[..., None, :]
    assert ((tq @ tk.transpose(-2, -1) - q @ k.transpose(-2, -1)).abs() <= bound).all()
    x = windows[:, :-1]
    diff = (kv.quantize_cache(model, "hadamard")(x) - model(x)).abs().max()
    assert diff < LOGIT_ATOL
    # not vacuous: rotating the keys alone changes the model
    keys_only = kv.quantize_cache(model, "hadamard")
    for b in keys_only.blocks:
        b.attn.qkv_transform = lambda q, k, v: (q, fwht(k), v)
    assert (keys_only(x) - model(x)).abs().max() > 1.0


def test_window_keeps_recent_tokens_bit_exact():
    q, k, v = _qkv(S=100)
    _, k_hat, v_hat = _transform("kivi2")(q, k, v)
    assert torch.equal(k_hat[:, :, -kv.WINDOW:], k[:, :, -kv.WINDOW:])
    assert torch.equal(v_hat[:, :, -kv.WINDOW:], v[:, :, -kv.WINDOW:])
    old = slice(0, 100 - kv.WINDOW)  # every older token is quantized: some element moved
    assert (k_hat[:, :, old] != k[:, :, old]).any(dim=-1).all()
    assert (v_hat[:, :, old] != v[:, :, old]).any(dim=-1).all()
    for S in (1, kv.WINDOW):  # a cache no longer than the window is all float
        _, k_hat, v_hat = _transform("kivi2")(q, k[:, :, :S], v[:, :, :S])
        assert torch.equal(k_hat, k[:, :, :S]) and torch.equal(v_hat, v[:, :, :S])


@pytest.mark.parametrize("name", kv.KV_SCHEME_NAMES)
def test_quantized_token_does_not_change_as_the_cache_grows(name):
    # what a cache that stores quantized entries holds: a token's value is fixed once it
    # is quantized (per token, calibrated constants, or a complete 32-token chunk),
    # whatever the cache length; only the float window moves with the length
    q, k, v = _qkv(S=128)
    t = _transform(name)
    tq, k_full, v_full = t(q, k, v)
    window = kv.get_kv_scheme(name).window
    for S in range(window + 1, 129, 7):
        tq_s, k_s, v_s = t(q, k[:, :, :S], v[:, :, :S])
        n_old = S - window
        assert torch.equal(tq_s, tq)
        assert torch.equal(k_s[:, :, :n_old], k_full[:, :, :n_old])
        assert torch.equal(v_s[:, :, :n_old], v_full[:, :, :n_old])


OTHER_SCHEMES = {  # a float window, and elements whose scales span groups (no reuse)
    "int4 + window": kv.KVScheme(name="int4 + window", element="int4", window=kv.WINDOW),
    "nvfp4": kv.KVScheme(name="nvfp4", element="nvfp4", group=16),
    "nf4_dq": kv.KVScheme(name="nf4_dq", element="nf4_dq", window=kv.WINDOW),
}


@pytest.mark.parametrize("name", [*kv.KV_SCHEME_NAMES, *OTHER_SCHEMES])
def test_a_growing_cache_reads_as_a_fresh_quantizer_reads_it(name, monkeypatch):
    # a layer's quantizer keeps what it quantized and, when the next cache starts with the
    # same entries, quantizes only the new ones: what quantizing all of it gives
    scheme = OTHER_SCHEMES.get(name) or kv.get_kv_scheme(name)
    scales = torch.tensor(3.0), torch.tensor(0.5)  # static FP8: any calibrated constants

    def fresh(*qkv):
        return kv._CacheQuantizer(scheme, *scales)(*qkv)

    def same(got, want):
        return all(torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
                   for a, b in zip(got, want, strict=True))

    quantized = []  # tokens each quantizer call was given (t's and fresh ones')
    for f in ("quantize_values", "quantize_keys"):
        real = getattr(kv, f)
        monkeypatch.setattr(kv, f, lambda x, s, f=real: quantized.append(x.shape[2]) or f(x, s))
    q, k, v = _qkv(S=100)
    t = kv._CacheQuantizer(scheme, *scales)
    mine = []  # tokens each of t's quantizer calls was given
    for S in range(1, 101):  # decoding
        want = fresh(q, k[:, :, :S], v[:, :, :S])
        before = len(quantized)
        assert same(t(q, k[:, :, :S], v[:, :, :S]), want), S
        mine += quantized[before:]
    if t.reuse and scheme.static is None:  # each entry once: those older than the window,
        W, chunks = scheme.window, scheme.key_axis == "channel"  # and kivi's key chunks
        assert sum(mine) == (96 if chunks else 100 - W) + 100 - W, mine
        assert max(mine) == (32 if chunks else 1), mine
    for S in (100, 64, 100, 37, 38):  # a repeat, a shorter cache, regrowth, a prefill
        assert same(t(q, k[:, :, :S], v[:, :, :S]), fresh(q, k[:, :, :S], v[:, :, :S])), S
    for change in ("k", "v"):
        for pos in (3, 90, 99):  # an old entry, one in the window of a kivi chunk, the newest
            x = {"k": k.clone(), "v": v.clone()}
            t(q, x["k"], x["v"])
            x[change][:, :, pos] += 1.0  # changed in place
            assert same(t(q, x["k"], x["v"]), fresh(q, x["k"], x["v"])), (change, pos)
            for zero in (0.0, -0.0):  # in a new tensor: +0, then -0 (equal, other bits)
                x[change] = x[change].clone()
                x[change][:, :, pos] = zero
                assert same(t(q, x["k"], x["v"]), fresh(q, x["k"], x["v"])), (change, zero)
    assert same(t(q, k[:1], v[:1]), fresh(q, k[:1], v[:1]))  # another batch
    assert same(t(q, k.double(), v.double()), fresh(q, k.double(), v.double()))  # dtype


def test_scale_shapes_per_channel_keys_per_token_values():
    _, k, v = _qkv(S=96)  # (B, H, S, D) = (2, 3, 96, 64)
    # keys: per channel, chunks of 32 tokens; values: per token, groups of 32 channels
    assert kv.quantize_keys(k, "kivi4").scales.shape == (2, 3, 64, 3)
    assert kv.quantize_values(v, "kivi4").scales.shape == (2, 3, 96, 2)
    assert kv.quantize_keys(k, "int4").scales.shape == (2, 3, 96, 2)
    assert kv.quantize_values(v, "fp8_dynamic").scales.shape == (2, 3, 96, 1)
    with pytest.raises(ValueError, match="whole chunks of 32"):
        kv.quantize_keys(k[:, :, :40], "kivi4")


@pytest.mark.parametrize("name, element, g", [
    ("int8", "int8", 32), ("int4", "int4", 32), ("int2", "int2", 32),
    ("fp8_dynamic", "fp8_e4m3", "channel"), ("hadamard_int4", "int4", 32),
])
def test_per_token_schemes_equal_fake_quantize(name, element, g):
    q, k, v = _qkv()
    tq, k_hat, v_hat = _transform(name)(q, k, v)
    if name.startswith("hadamard"):
        assert torch.equal(tq, fwht(q))
        k = fwht(k)
    assert torch.equal(k_hat, qlab.fake_quantize(k, element, g))
    assert torch.equal(v_hat, qlab.fake_quantize(v, element, g))
    assert not torch.equal(k_hat, k)


def _kivi_keys_by_hand(k: torch.Tensor, bits: int, chunk: int) -> torch.Tensor:
    """Per channel, per chunk of tokens, asymmetric: qlab's rule (range widened to include 0,
    integer zero point; not KIVI's [min, max] with an fp16 min) written out without qlab."""
    B, H, S, D = k.shape
    x = k.reshape(B, H, S // chunk, chunk, D)  # shape: (B, H, chunks, chunk, D)
    lo = x.amin(dim=3, keepdim=True).clamp(max=0.0)  # over the chunk's tokens, per channel
    hi = x.amax(dim=3, keepdim=True).clamp(min=0.0)
    qmax = 2**bits - 1
    s = ((hi - lo) / qmax).half().float()  # fp16 scale, DESIGN.md
    s = torch.where(s == 0, torch.ones_like(s), s)
    z = torch.clamp(torch.round(-lo / s), 0, qmax)
    codes = torch.clamp(torch.round(x / s) + z, 0, qmax)
    return ((codes - z) * s).reshape(B, H, S, D)


@pytest.mark.parametrize("name, bits", [("kivi4", 4), ("kivi2", 2)])
def test_kivi_matches_an_independent_formulation_of_qlabs_rule(name, bits):
    q, k, v = _qkv(S=100)
    _, k_hat, v_hat = _transform(name)(q, k, v)
    n_old = 100 - kv.WINDOW  # 68: chunks 0..2 (positions 0..95) are complete
    by_hand = _kivi_keys_by_hand(k[:, :, :96], bits, 32)
    assert torch.equal(k_hat[:, :, :n_old], by_hand[:, :, :n_old])
    # values per token: qlab's asymmetric group quantizer, as the per-token int schemes
    v_qlab = qlab.fake_quantize(v, f"uint{bits}_asym", 32)
    assert torch.equal(v_hat[:, :, :n_old], v_qlab[:, :, :n_old])


@torch.no_grad()
def test_fp8_static_scales_are_calibration_amax_over_448(model, windows):
    seen = []  # K and V of the float model, as they enter the cache
    m = kv.quantize_cache(model, "hadamard")
    for b in m.blocks:
        b.attn.qkv_transform = None
        b.attn.kv_transform = lambda t: seen.append(t) or t
    m(windows[:, :-1])
    for per, reduce in (("tensor", lambda t: t.abs().amax()),
                        ("head", lambda t: t.abs().amax(dim=(0, 2, 3))[:, None, None])):
        qm = kv.quantize_cache(model, f"fp8_static_{per}", calib=windows)
        for i, block in enumerate(qm.blocks):
            t = block.attn.qkv_transform
            assert torch.equal(t.k_scale, reduce(seen[2 * i]) / 448.0)
            assert torch.equal(t.v_scale, reduce(seen[2 * i + 1]) / 448.0)
        # the stored value is E4M3(K / k_scale) * k_scale; torch's cast is the oracle
        t = qm.blocks[1].attn.qkv_transform
        k = seen[2] * 1.5  # 1.5x the calibration amax: saturates at 448, as qlab does
        _, k_hat, _ = t(k[:, :, -1:], k, k)
        expect = (k / t.k_scale).to(torch.float8_e4m3fn).float() * t.k_scale
        assert torch.equal(k_hat, expect)
        assert (k_hat.abs() <= 448.0 * t.k_scale * (1 + EPS32)).all()


@torch.no_grad()
def test_errors_rise_as_bits_fall(model, windows):
    ref = quality.logits(model, windows)

    def kl(name):
        return quality.compare(ref, quality.logits(kv.quantize_cache(model, name), windows),
                               windows, n_boot=10).kl

    kls = {n: kl(n) for n in ("int8", "int4", "int2", "kivi4", "kivi2", "hadamard")}
    assert kls["hadamard"] < 1e-9 < kls["int8"] < kls["int4"] < kls["int2"]
    assert kls["kivi4"] < kls["kivi2"]
    ppl = quality.compare(ref, quality.logits(kv.quantize_cache(model, "int2"), windows),
                          windows, n_boot=10)
    assert ppl.ppl > 1.5 * ppl.ppl_ref


@torch.no_grad()
def test_hadamard_decode_equals_full_forward(model):
    # the transform sees the whole cache at every decode step; with no rounding to a grid
    # (a quantized scheme can flip a code on a float32-rounding difference) decode and
    # full forward agree to float32 rounding, as for the float model
    qm = kv.quantize_cache(model, "hadamard")
    idx = quality.validation_windows(2, 48)[:, :48]
    cache = qm.new_cache()
    steps = [qm(idx[:, :8], cache)] + [qm(idx[:, t:t + 1], cache) for t in range(8, 48)]
    assert (torch.cat(steps, dim=1) - qm(idx)).abs().max() < LOGIT_ATOL


@torch.no_grad()
def test_decode_logits(model):
    w = quality.validation_windows(2, 64)
    ref = quality.logits(model, w)
    assert (kv.decode_logits(model, w) - ref).abs().max() < LOGIT_ATOL
    # a window as long as the sequence: every key/value any query reads is float
    long_window = kv.KVScheme(name="kivi2_w64", element="uint2_asym", key_axis="channel",
                              window=64)
    assert (kv.decode_logits(kv.quantize_cache(model, long_window), w) - ref).abs().max() \
        < LOGIT_ATOL
    # kivi2 (32-token window) on 64 tokens: decoding, the first 32 queries read a cache
    # no longer than the window (all float); the full forward reads the cache after the
    # last token, where positions 0..31 are quantized, for every query
    kivi2 = kv.quantize_cache(model, "kivi2")
    kl_full = quality.kl_per_token(ref, quality.logits(kivi2, w))[:, :kv.WINDOW]
    kl_decode = quality.kl_per_token(ref, kv.decode_logits(kivi2, w))[:, :kv.WINDOW]
    assert kl_decode.max() < 1e-7 < 1e-3 < kl_full.mean()


def test_bits_per_element():
    assert kv.bits_per_element("int8") == 8 + 16 / 32
    assert kv.bits_per_element("int4") == kv.bits_per_element("hadamard_int4") == 4 + 16 / 32
    assert kv.bits_per_element("int2") == 2 + 16 / 32
    kivi4 = 4 + (16 + 4) / 32  # fp16 scale + 4-bit zero point per 32 elements
    assert math.isclose(kv.bits_per_element("kivi4", seq_len=256),
                        (224 * kivi4 + 32 * 16) / 256, rel_tol=1e-12)
    assert kv.bits_per_element("kivi2", seq_len=32) == 16.0  # all in the window
    assert kv.bits_per_element("fp8_static_tensor") == kv.bits_per_element("fp8_static_head") == 8
    assert kv.bits_per_element("fp8_dynamic", head_dim=64) == 8 + 32 / 64  # fp32 scale per token
    assert kv.bits_per_element("hadamard") == 16.0


@torch.no_grad()
def test_scale_key_channel_keeps_the_function_and_scales_one_key_channel(model, windows):
    m = kv.scale_key_channel(model, 5, 20.0)
    x = windows[:, :-1]
    assert (m(x) - model(x)).abs().max() < LOGIT_ATOL
    k_ref = [kv_[0] for kv_ in quality._cache_entries(model, windows, None)]
    k_new = [kv_[0] for kv_ in quality._cache_entries(m, windows, None)]
    others = torch.arange(64) != 5
    # layer 0 reads the same embeddings: the other channels are bit-identical, channel 5 is
    # 20x (one rounding of W * 20); later layers read a residual stream that differs by
    # float32 rounding (keys up to ~10 in size: atol 1e-4)
    assert torch.equal(k_new[0][..., others], k_ref[0][..., others])
    for i, (a, b) in enumerate(zip(k_ref, k_new, strict=True)):  # (N, H, T, D) per layer
        atol = 1e-5 if i == 0 else 1e-4
        torch.testing.assert_close(b[..., 5], 20.0 * a[..., 5], rtol=1e-5, atol=20 * atol)
        torch.testing.assert_close(b[..., others], a[..., others], rtol=1e-5, atol=atol)
    # per-channel keys absorb the outlier in their scale: kivi4's attention error is unchanged
    e_ref, e_new = (kv.attention_errors(mm, "kivi4", windows) for mm in (model, m))
    # (up to codes flipped by float32 rounding of the rescaled keys: 1e-4 on errors ~0.01)
    torch.testing.assert_close(e_new["outputs"], e_ref["outputs"], rtol=0, atol=1e-4)
    assert (kv.attention_errors(m, "int4", windows)["outputs"].mean()
            > 2 * kv.attention_errors(model, "int4", windows)["outputs"].mean())
    for bad in ({"channel": 64, "factor": 2.0}, {"channel": 0, "factor": 0.0}):
        with pytest.raises(ValueError):
            kv.scale_key_channel(model, **bad)


@pytest.mark.parametrize("name", ["int4", "kivi2", "hadamard_int4", "fp8_static_head"])
@torch.no_grad()
def test_attention_errors_equal_what_each_decode_step_reads(model, windows, name):
    # independent formulation: at query t, call the scheme's transform on the cache 0..t,
    # as decode_logits does, and compute that one query's attention directly
    seen = []
    m = kv.quantize_cache(model, "hadamard")
    for b in m.blocks:
        b.attn.qkv_transform = lambda q, k, v: seen.append((q, k, v)) or (q, k, v)
    m(windows[:, :-1])
    err = kv.attention_errors(model, name, windows, calib=windows)
    qm = kv.quantize_cache(model, name, calib=windows)
    layer = 2
    q, k, v = seen[layer]
    tr = qm.blocks[layer].attn.qkv_transform
    for t in (0, 31, 32, 33, 64, 100, 127):
        qt, kt, vt = q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1]
        q_r, k_hat, v_hat = tr(qt, kt, vt)
        att = qt @ kt.transpose(-2, -1) / 8.0  # sqrt(64)
        att_hat = q_r @ k_hat.transpose(-2, -1) / 8.0
        y, y_hat = att.softmax(-1) @ vt, att_hat.softmax(-1) @ v_hat
        rms = (att_hat - att).double().pow(2).mean().sqrt()
        rel = (y_hat - y).double().norm() / y.double().norm()
        torch.testing.assert_close(err["scores"][layer, t], rms, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(err["outputs"][layer, t], rel, rtol=1e-3, atol=1e-6)
    if name == "kivi2":  # the first 32 queries read only float entries
        assert torch.equal(err["outputs"][:, :32], torch.zeros(4, 32, dtype=torch.float64))
    assert (err["outputs"][:, 40:] > 0).all()


def test_attention_errors_of_a_rotation_alone_are_float_rounding(model, windows):
    err = kv.attention_errors(model, "hadamard", windows)
    assert err["scores"].max() < 1e-5 and err["outputs"].max() < 1e-5


def test_attention_errors_refuse_partial_key_chunks(model):
    w = quality.validation_windows(2, 100)  # 100 tokens: not whole chunks of 32
    with pytest.raises(ValueError, match="multiple of 32 tokens"):
        kv.attention_errors(model, "kivi4", w)
    assert kv.attention_errors(model, "int4", w)["outputs"].shape == (4, 100)
