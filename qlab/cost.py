"""The cost model of decode: bytes of weights, the bandwidth ceiling, KV-cache capacity.

At batch 1 every generated token reads every weight once, so
    tokens/s <= bandwidth / weight_bytes
and whatever memory the weights leave free holds KV cache, i.e. concurrent sequences.
Sizes are decimal (1 GB = 1e9 bytes), as datasheets quote them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "Device",
    "ModelConfig",
    "DEVICES",
    "MODELS",
    "bits_per_weight",
    "weight_bytes",
    "decode_ceiling_tokens_per_s",
    "kv_cache_bytes_per_token",
    "max_concurrent_sequences",
]


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float
    # dense peak FLOP/s (no 2:4 sparsity): "bf16" and "fp8" tensor cores (None: not
    # supported), "fp32" on ordinary CUDA cores
    peak_flops: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_params: float
    n_layers: int
    n_kv_heads: int
    head_dim: int


DEVICES = {
    d.name: d
    for d in [
        # H100 SXM / H200 datasheets: 80 GB HBM3, 3.35 TB/s / 141 GB HBM3e, 4.8 TB/s;
        # 989 TFLOP/s bf16, 1,979 fp8 (dense), 67 fp32
        Device("H100 SXM", 80e9, 3.35e12, {"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 67e12}),
        Device("H200", 141e9, 4.8e12, {"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 67e12}),
        # A100 datasheet (SXM): 80 GB, 2,039 GB/s, 312 TFLOP/s bf16, 19.5 fp32; no fp8 (sm_80)
        Device("A100 80GB", 80e9, 2.039e12, {"bf16": 312e12, "fp8": None, "fp32": 19.5e12}),
        # Blackwell datasheet / HGX B200 per GPU: 192 GB HBM3e, 8 TB/s, 2.25 / 4.5 PFLOP/s
        Device("B200", 192e9, 8.0e12, {"bf16": 2250e12, "fp8": 4500e12}),
        # Ada whitepaper, RTX 4090: 24 GB GDDR6X, 1,008 GB/s; 165.2 TFLOP/s bf16 and 330.3
        # fp8 with fp32 accumulate, 82.6 fp32
        Device("RTX 4090", 24e9, 1.008e12, {"bf16": 165.2e12, "fp8": 330.3e12, "fp32": 82.6e12}),
    ]
}

MODELS = {
    m.name: m
    for m in [
        # Hugging Face config.json of each model: num_hidden_layers, num_key_value_heads,
        # hidden_size / num_attention_heads; parameter counts from the model cards.
        ModelConfig("Llama-2-7B", 6.74e9, 32, 32, 128),
        ModelConfig("Llama-2-70B", 69.0e9, 80, 8, 128),
        ModelConfig("Llama-3-8B", 8.03e9, 32, 8, 128),
        ModelConfig("Llama-3-70B", 70.6e9, 80, 8, 128),
    ]
}


def bits_per_weight(
    bits: float, group_size: int | None = None, scale_bits: float = 16, zero_bits: float = 0
) -> float:
    """Storage bits per weight: bits + (scale_bits + zero_bits) / group_size.

    bits_per_weight(4, 128, 16, 4) == 4.15625. group_size None: per-tensor, no overhead.
    """
    if bits <= 0:
        raise ValueError(f"bits must be positive, got {bits}")
    if group_size is None:
        return float(bits)
    if group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size}")
    return bits + (scale_bits + zero_bits) / group_size


def weight_bytes(n_params: float, bits_per_weight: float) -> float:
    """Bytes to store n_params weights: 70e9 at 16 bits is 140e9 bytes."""
    return n_params * bits_per_weight / 8


def decode_ceiling_tokens_per_s(weight_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Batch-1 decode ceiling: every weight byte crosses the bus once per token."""
    if weight_bytes <= 0:
        raise ValueError("weight_bytes must be positive")
    return bandwidth_bytes_per_s / weight_bytes


def _model(model) -> ModelConfig:
    return MODELS[model] if isinstance(model, str) else model


def _device(device) -> Device:
    return DEVICES[device] if isinstance(device, str) else device


def kv_cache_bytes_per_token(model: ModelConfig | str, kv_bits: float = 16) -> float:
    """layers x kv_heads x head_dim x 2 (K and V) x bytes per element."""
    m = _model(model)
    return m.n_layers * m.n_kv_heads * m.head_dim * 2 * kv_bits / 8


def max_concurrent_sequences(
    model: ModelConfig | str,
    bits_per_weight: float,
    device: Device | str,
    context_len: int,
    kv_bits: float = 16,
    n_devices: int = 1,
    reserve_bytes: float = 0.0,
) -> int:
    """Sequences of context_len tokens whose KV cache fits beside the weights (0 if none).

    reserve_bytes: memory held back for activations and the runtime.
    """
    m, d = _model(model), _device(device)
    free = n_devices * d.memory_bytes - weight_bytes(m.n_params, bits_per_weight) - reserve_bytes
    per_seq = kv_cache_bytes_per_token(m, kv_bits) * context_len
    return max(0, math.floor(free / per_seq))
