"""qlab.cost: the figures of notebook 00 and 02."""

import pytest

from qlab import cost


def test_bits_per_weight():
    assert cost.bits_per_weight(4, 128, 16, 4) == 4.15625
    assert cost.bits_per_weight(4, 64, 16, 4) == 4.3125
    assert cost.bits_per_weight(4, 32, 16, 4) == 4.625
    assert cost.bits_per_weight(4) == 4.0
    assert cost.bits_per_weight(8, 128) == 8.125
    with pytest.raises(ValueError):
        cost.bits_per_weight(4, 0)


def test_decode_ceiling():
    b16 = cost.weight_bytes(70e9, 16)
    assert b16 == 140e9
    b4 = cost.weight_bytes(70e9, cost.bits_per_weight(4, 128, 16, 4))
    assert abs(b4 - 36.4e9) < 0.05e9
    assert round(cost.decode_ceiling_tokens_per_s(b16, 3e12)) == 21
    assert round(cost.decode_ceiling_tokens_per_s(b4, 3e12)) == 82


def test_decode_ceiling_per_sequence_reads_every_cache():
    # notebook 00: at full occupancy of an 80 GB device, 8-bit (7 sequences) and 4-bit g128
    # (32 sequences) weights give each user about the same speed; only the total differs
    m = cost.ModelConfig("toy", 70e9, 80, 8, 128)
    per_seq = cost.kv_cache_bytes_per_token(m) * 4096
    speeds = {}
    for bpw in (8, cost.bits_per_weight(4, 128, 16, 4)):
        n = cost.max_concurrent_sequences(m, bpw, "H100 SXM", 4096)
        wb = cost.weight_bytes(70e9, bpw)
        speeds[n] = cost.decode_ceiling_per_sequence(wb, per_seq, n, 3e12)
        assert speeds[n] == 3e12 / (wb + n * per_seq)
    assert sorted(speeds) == [7, 32]
    assert round(speeds[7], 1) == 37.8 and round(speeds[32], 1) == 37.8
    assert round(7 * speeds[7]) == 264 and round(32 * speeds[32]) == 1210
    # one sequence with no context: the batch-1 ceiling
    assert cost.decode_ceiling_per_sequence(70e9, 0, 1, 3e12) == (
        cost.decode_ceiling_tokens_per_s(70e9, 3e12))


def test_kv_cache_and_concurrency():
    # Llama-2-70B: 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    assert cost.kv_cache_bytes_per_token("Llama-2-70B") == 80 * 8 * 128 * 2 * 2
    assert cost.kv_cache_bytes_per_token("Llama-3-8B", kv_bits=8) == 32 * 8 * 128 * 2
    m = cost.ModelConfig("toy", 70e9, 80, 8, 128)
    per_seq = cost.kv_cache_bytes_per_token(m) * 4096
    n8 = cost.max_concurrent_sequences(m, 8, "H100 SXM", 4096)
    assert n8 == int((80e9 - 70e9) // per_seq)
    assert cost.max_concurrent_sequences(m, 16, "H100 SXM", 4096) == 0  # does not fit
    assert cost.max_concurrent_sequences(m, 16, "H100 SXM", 4096, n_devices=2) > 0
    n4 = cost.max_concurrent_sequences(m, 4.15625, "H100 SXM", 4096)
    assert n4 >= 4 * n8  # saved weight memory becomes KV capacity
    for d in cost.DEVICES.values():
        assert d.memory_bytes > 1e10 and d.bandwidth_bytes_per_s > 1e11


def test_presets_from_the_datasheets():
    # Ada (L4, L40S, RTX 4090), Hopper and Blackwell have FP8 tensor cores; Ampere does not
    for name in ("L4", "L40S", "RTX 4090", "H100 SXM", "H200", "B200"):
        peak = cost.DEVICES[name].peak_flops  # datasheets round: FP8 is 2x BF16 within 2 %
        assert peak["fp8"] == pytest.approx(2 * peak["bf16"], rel=0.02)
    assert cost.DEVICES["A100 80GB"].peak_flops["fp8"] is None
    # only Blackwell lists FP4 tensor cores, at twice its FP8 rate
    assert [n for n, d in cost.DEVICES.items() if d.peak_flops.get("fp4")] == ["B200"]
    assert cost.DEVICES["B200"].peak_flops["fp4"] == 2 * cost.DEVICES["B200"].peak_flops["fp8"]
    l4, l40s = cost.DEVICES["L4"], cost.DEVICES["L40S"]
    assert (l4.memory_bytes, l4.bandwidth_bytes_per_s) == (24e9, 300e9)
    assert (l40s.memory_bytes, l40s.bandwidth_bytes_per_s) == (48e9, 864e9)
    # grouped-query attention: Llama-3-70B has 64 query heads and caches 8 K/V heads
    m = cost.MODELS["Llama-3-70B"]
    assert m.n_heads == 64 and m.n_heads // m.n_kv_heads == 8
    assert cost.MODELS["Llama-2-7B"].n_heads == cost.MODELS["Llama-2-7B"].n_kv_heads  # no GQA


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: cost.weight_bytes(-70e9, 16), "n_params"),
        (lambda: cost.weight_bytes(70e9, -4), "bits_per_weight"),
        (lambda: cost.weight_bytes(70e9, 0), "bits_per_weight"),
        (lambda: cost.weight_bytes(float("nan"), 4), "n_params"),
        (lambda: cost.bits_per_weight(-4), "bits"),
        (lambda: cost.bits_per_weight(4, 128, scale_bits=-16), "scale_bits"),
        (lambda: cost.bits_per_weight(4, 128, 16, zero_bits=-4), "zero_bits"),
        (lambda: cost.bits_per_weight(4, -128), "group_size"),
        (lambda: cost.bits_per_weight(4, 0), "group_size"),
        (lambda: cost.decode_ceiling_tokens_per_s(-1e9, 3e12), "weight_bytes"),
        (lambda: cost.decode_ceiling_tokens_per_s(1e9, -3e12), "bandwidth"),
        (lambda: cost.kv_cache_bytes_per_token("Llama-3-8B", kv_bits=-8), "kv_bits"),
        (lambda: cost.decode_ceiling_per_sequence(70e9, -1, 1, 3e12), "kv_bytes_per_sequence"),
        (lambda: cost.decode_ceiling_per_sequence(70e9, 1e9, 0, 3e12), "n_sequences"),
        (lambda: cost.max_concurrent_sequences("Llama-3-8B", 4, "H100 SXM", 0), "context_len"),
        (lambda: cost.max_concurrent_sequences("Llama-3-8B", -4, "H100 SXM", 4096),
         "bits_per_weight"),
        (lambda: cost.max_concurrent_sequences("Llama-3-8B", 4, "H100 SXM", 4096, n_devices=0),
         "n_devices"),
        (lambda: cost.max_concurrent_sequences("Llama-3-8B", 4, "H100 SXM", 4096,
                                               reserve_bytes=-1e9), "reserve_bytes"),
        (lambda: cost.ModelConfig("bad", -7e9, 32, 8, 128), "n_params"),
        (lambda: cost.ModelConfig("bad", 7e9, 32, 0, 128), "n_kv_heads"),
        (lambda: cost.ModelConfig("bad", 7e9, 32, 8, 128, n_heads=12), "multiple of n_kv_heads"),
        (lambda: cost.Device("bad", -80e9, 3e12), "memory_bytes"),
        (lambda: cost.Device("bad", 80e9, 0), "bandwidth"),
    ],
)
def test_negative_sizes_and_widths_are_refused(call, match):
    # these used to return negative bytes (or divide by zero) instead of saying what is wrong
    with pytest.raises(ValueError, match=match):
        call()


def test_unknown_presets_say_what_exists():
    with pytest.raises(KeyError, match="Llama-3-70B"):
        cost.kv_cache_bytes_per_token("Llama-4-1T")
    with pytest.raises(KeyError, match="H100 SXM"):
        cost.max_concurrent_sequences("Llama-3-8B", 4, "TPU", 4096)
