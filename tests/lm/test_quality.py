"""qlab.lm.quality: quantizers applied where they claim, metrics in sane ranges."""

import pytest
import torch

import qlab
from qlab.lm import quality as Q

N_WINDOWS, BLOCK = 4, 128  # 512 predictions: enough to separate 8-bit from 2-bit by 100x


@pytest.fixture(scope="module")
def base():
    return Q.load_model()


@pytest.fixture(scope="module")
def windows():
    return Q.validation_windows(N_WINDOWS, BLOCK)


@pytest.fixture(scope="module")
def ref(base, windows):
    return Q.logits(base, windows)


def _cmp(model, ref, windows):
    return Q.compare(ref, Q.logits(model, windows), windows)


def test_identity_comparison_is_zero(ref, windows):
    c = Q.compare(ref, ref, windows)
    assert c.kl == 0.0 and c.flip_rate == 0.0 and c.ppl == c.ppl_ref


def test_weights_8bit_tiny_2bit_large(base, ref, windows):
    c8 = _cmp(Q.quantize_weights(base, "int8"), ref, windows)
    c2 = _cmp(Q.quantize_weights(base, "int2"), ref, windows)
    assert 0 < c8.kl < 1e-3 and c8.flip_rate < 0.02 and abs(c8.ppl_change) < 0.01
    assert c2.kl > 0.3 and c2.ppl_change > 0.2
    for c in (c8, c2):
        assert 0.0 <= c.flip_rate <= 1.0
    assert c2.flip_rate > c8.flip_rate


def test_inputs_are_not_modified(base):
    before = {k: v.clone() for k, v in base.state_dict().items()}
    Q.quantize_weights(base, "int2")
    Q.prune_magnitude(base, 0.9)
    Q.low_rank(base, 2)
    Q.quantize_activations(base, "int4")
    Q.quantize_kv_cache(base, "int4")
    after = base.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not lin._forward_pre_hooks for lin in base.linear_layers().values())
    assert all(b.attn.kv_transform is None for b in base.blocks)


def test_weights_are_on_the_qlab_grid(base):
    q = Q.quantize_weights(base, "int4", "channel", only=["blocks.1.mlp.fc1"])
    w, w_q = base.blocks[1].mlp.fc1.weight, q.blocks[1].mlp.fc1.weight
    assert torch.equal(w_q, qlab.fake_quantize(w, "int4", "channel"))
    assert torch.equal(q.blocks[0].mlp.fc1.weight, base.blocks[0].mlp.fc1.weight)
    # int4 per channel: at most 15 distinct values per row
    assert max(len(row.unique()) for row in w_q) <= 15


def test_activation_and_kv_8bit_small(base, ref, windows):
    for model in (Q.quantize_activations(base, "int8", "token"),
                  Q.quantize_kv_cache(base, "int8", "token"),
                  Q.quantize_kv_cache(base, "fp8_e4m3")):
        c = _cmp(model, ref, windows)
        assert 0 < c.kl < 1e-2 and c.flip_rate < 0.05


def test_kv_per_tensor_is_refused(base):
    with pytest.raises(ValueError, match="per-tensor KV"):
        Q.quantize_kv_cache(base, "int8", "tensor")


def test_keeping_every_channel_in_fp_is_the_baseline(base, ref, windows):
    keep = {n: torch.arange(lin.in_features) for n, lin in base.linear_layers().items()}
    out = Q.logits(Q.quantize_activations(base, "int2", "token", keep_fp=keep), windows)
    assert torch.equal(out, ref)


def test_outlier_channels_and_absmax(base, windows):
    amax = Q.input_absmax(base, windows[:2])
    assert set(amax) == set(base.linear_layers())
    idx = Q.outlier_channels(base, windows[:2], 3)
    name = "blocks.0.mlp.fc2"
    assert amax[name][idx[name]].min() >= amax[name].sort().values[-3]


def test_pruning_curve_monotone_ish(base, ref, windows):
    assert torch.equal(Q.logits(Q.prune_magnitude(base, 0.0), windows), ref)
    ppl = [_cmp(Q.prune_magnitude(base, s), ref, windows).ppl for s in (0.2, 0.5, 0.8, 0.95)]
    # more zeros never helps by more than 1 % (noise), and 95 % sparsity is a disaster
    assert all(b > a * 0.99 for a, b in zip(ppl[:-1], ppl[1:], strict=True))
    assert ppl[-1] > 2 * ppl[0]
    q = Q.prune_magnitude(base, 0.5)
    w = q.blocks[0].attn.qkv.weight
    assert abs((w == 0).float().mean().item() - 0.5) < 1e-3


def test_low_rank(base, ref, windows):
    full = Q.logits(Q.low_rank(base, 10_000), windows)
    assert Q.kl_per_token(ref, full).max() < 1e-6  # full-rank SVD reconstructs W
    assert torch.linalg.matrix_rank(Q.low_rank(base, 8).blocks[0].mlp.fc1.weight) == 8
    assert Q.low_rank_params(base, 8) == sum(
        8 * sum(lin.weight.shape) for lin in base.linear_layers().values())


def test_worst_examples_and_positions(base, ref, windows):
    q = Q.logits(Q.quantize_weights(base, "int3"), windows)
    kl = Q.kl_per_token(ref, q)
    worst = Q.worst_examples(ref, q, windows, k=4)
    assert [w["kl"] for w in worst] == sorted((w["kl"] for w in worst), reverse=True)
    assert worst[0]["kl"] == pytest.approx(kl.max().item())
    w0 = worst[0]
    assert kl[w0["window"], w0["position"]].item() == pytest.approx(w0["kl"])
    assert Q.kl_by_position(ref, q).shape == (BLOCK,)


def test_layer_sensitivity(base, ref, windows):
    w = windows[:2]
    sens = Q.layer_sensitivity(base, w, lambda m, n: Q.quantize_weights(m, "int3", only=[n]))
    assert list(sens) == list(base.linear_layers())
    assert all(v > 0 for v in sens.values())
    with pytest.raises(KeyError, match="no linear layer"):
        Q.quantize_weights(base, "int4", only=["blocks.9.attn.qkv"])


def test_move_scale_into_layernorm_keeps_function_creates_outlier(base, ref, windows):
    m = Q.move_scale_into_layernorm(base, 83, 30.0)
    # same function up to float32 rounding (logits reach |22|; measured 2.5e-5)
    assert (Q.logits(m, windows) - ref).abs().max() < 1e-3
    amax = Q.input_absmax(m, windows[:1])["blocks.1.mlp.fc1"]
    assert amax.argmax() == 83 and amax[83] > 10 * amax.median()
    # ...which per-token int8 activations notice, and keeping channel 83 in float undoes
    a8 = Q.compare(ref, Q.logits(Q.quantize_activations(m, "int8"), windows), windows)
    keep = {n: torch.tensor([83]) for n in base.linear_layers() if n.endswith(("qkv", "fc1"))}
    a8k = Q.compare(ref, Q.logits(Q.quantize_activations(m, "int8", keep_fp=keep), windows),
                    windows)
    assert a8.kl > 5 * a8k.kl
    # the LayerNorm bias must be scaled with the gain: the gain alone changes the function
    gain_only = Q.move_scale_into_layernorm(base, 83, 30.0, bias=False)
    assert (Q.logits(gain_only, windows) - ref).abs().max() > 0.01


def test_bootstrap_interval_of_the_mean():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(400, generator=g, dtype=torch.float64) + 3.0
    lo, hi = Q.bootstrap_mean_ci(v, n_boot=2000)
    se = float(v.std() / 400**0.5)  # normal theory: the 95 % interval is mean +- 1.96 se
    assert lo < float(v.mean()) < hi
    assert abs((hi - lo) - 2 * 1.96 * se) < 0.15 * (2 * 1.96 * se)
    assert Q.bootstrap_mean_ci(v, n_boot=2000) == (lo, hi)  # seeded: reproducible
    lo4, hi4 = Q.bootstrap_mean_ci(v[:100], n_boot=2000)  # 4x fewer windows: ~2x wider
    assert 1.6 < (hi4 - lo4) / (hi - lo) < 2.5
    with pytest.raises(ValueError, match="at least one"):
        Q.bootstrap_mean_ci(torch.tensor([]))


def test_comparison_intervals_bracket_the_estimates(base, ref, windows):
    c = _cmp(Q.quantize_weights(base, "int3"), ref, windows)
    assert c.ppl_change_ci[0] <= c.ppl_change <= c.ppl_change_ci[1]
    assert c.kl_ci[0] <= c.kl <= c.kl_ci[1] and c.kl_ci[0] > 0
    assert c.flip_rate_ci[0] <= c.flip_rate <= c.flip_rate_ci[1]
    assert "[" in c.row_ci()
    same = Q.compare(ref, ref, windows)
    assert same.kl_ci == (0.0, 0.0) and same.ppl_change_ci == (0.0, 0.0)


def test_activation_quantizers_are_removed_by_their_handles(base, ref, windows):
    q = Q.quantize_activations(base, "int2", "token")
    other = q.blocks[0].mlp.fc1.register_forward_pre_hook(lambda _m, args: None)
    assert len(q.activation_quantizers) == len(base.linear_layers())
    # input_absmax works on a copy without the quantizers: the same absmax as the baseline's
    assert all(torch.equal(a, b) for a, b in zip(Q.input_absmax(q, windows[:1]).values(),
                                                  Q.input_absmax(base, windows[:1]).values(),
                                                  strict=True))
    # ...and leaves q's own quantizers (and a foreign hook) in place
    assert len(q.blocks[0].mlp.fc1._forward_pre_hooks) == 2
    Q._drop_activation_quantizers(q)
    assert list(q.blocks[0].mlp.fc1._forward_pre_hooks) == [other.id]  # only ours removed
    other.remove()
    assert torch.equal(Q.logits(q, windows), ref)
    # stacking two calls keeps both sets of handles
    twice = Q.quantize_activations(Q.quantize_activations(base, "int8"), "int8")
    assert len(twice.activation_quantizers) == 2 * len(base.linear_layers())


def test_kv_entry_errors_show_where_cache_error_comes_from(base, windows):
    e4 = Q.kv_entry_errors(base, windows, "int4", "token")
    e8 = Q.kv_entry_errors(base, windows, "int8", "token")
    n_layer = len(base.blocks)
    assert e4["own"].shape == e4["inherited"].shape == (n_layer, BLOCK)
    # layer 0 reads the embeddings: nothing to inherit; later layers inherit from earlier ones
    assert torch.equal(e4["inherited"][0], torch.zeros(BLOCK, dtype=torch.float64))
    assert (e4["inherited"][1:] > 0).all() and (e4["own"] > 0).all()
    # an int4 entry's own error is ~1/sqrt(12) of a 1/7-of-absmax step per element: ~10 %
    assert 0.03 < float(e4["own"].mean()) < 0.2
    assert float(e8["own"].mean()) < float(e4["own"].mean()) / 8  # 4 more bits: ~18x finer
    # position 0 attends to one entry only; later positions inherit from every earlier one
    late, first = e4["inherited"][1:, -BLOCK // 4:].mean(), e4["inherited"][1:, 0].mean()
    assert late > 1.5 * first
    # the quantized run is the model quantize_kv_cache builds: record what its cache receives
    q = Q.quantize_kv_cache(base, "int4", "token")
    received = [[] for _ in q.blocks]
    for i, block in enumerate(q.blocks):
        quantizer = block.attn.kv_transform
        block.attn.kv_transform = lambda t, i=i, f=quantizer: received[i].append(t) or f(t)
    Q.logits(q, windows, batch=len(windows))
    ours = Q._cache_entries(base, windows, lambda t: qlab.fake_quantize(t, "int4", "channel"))
    assert all(torch.equal(torch.stack(r), o) for r, o in zip(received, ours, strict=True))
