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
        assert d.memory_bytes > 1e10 and d.bandwidth_bytes_per_s > 5e11
