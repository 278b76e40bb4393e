"""The cost model of decode: bytes of weights, the bandwidth ceiling, KV-cache capacity.

At batch 1 a dense model reads every weight once per generated token (all but the embedding
table, of which it reads one row; a mixture-of-experts model reads only the experts it routes
to), so
    tokens/s <= bandwidth / weight_bytes
and whatever memory the weights leave free holds KV cache, i.e. concurrent sequences.
With n sequences decoded together, each step also reads every sequence's KV cache:
    tokens/s per sequence <= bandwidth / (weight_bytes + n * kv_bytes_per_sequence).
Sizes are decimal (1 GB = 1e9 bytes). A preset's memory is the datasheet's "80 GB" read as
80e9 bytes: an H100 SXM in fact reports 81,559 MiB (85.5e9 bytes) to nvidia-smi, and the
runtime (CUDA context, allocator, activations) takes some of that back. Nothing is reserved
unless reserve_bytes says so: every figure here is an idealised ceiling, not a prediction.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

__all__ = [
    "Device",
    "ModelConfig",
    "DEVICES",
    "MODELS",
    "bits_per_weight",
    "weight_bytes",
    "decode_ceiling_tokens_per_s",
    "decode_ceiling_per_sequence",
    "kv_cache_bytes_per_token",
    "max_concurrent_sequences",
]


def _require(ok: bool, what: str, value, fix: str) -> None:
    """Raise a ValueError saying which input was wrong and what to do (NaN fails too)."""
    if not ok:
        raise ValueError(f"{what} must be {fix}, got {value!r}")


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(what: str, value) -> None:
    _require(_real(value) and value > 0, what, value, "a positive number")


def _non_negative(what: str, value) -> None:
    _require(_real(value) and value >= 0, what, value, "a number >= 0")


def _positive_int(what: str, value) -> None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0
    _require(ok, what, value, "a positive integer")


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float
    # dense peak FLOP/s (no 2:4 sparsity): "bf16" and "fp8" tensor cores (None: not
    # supported), "fp4" where the tensor cores take FP4 (Blackwell), "fp32" on ordinary
    # CUDA cores
    peak_flops: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _positive(f"Device {self.name!r}: memory_bytes", self.memory_bytes)
        _positive(f"Device {self.name!r}: bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    n_params: float
    n_layers: int
    n_kv_heads: int
    head_dim: int
    # query heads; more than n_kv_heads means grouped-query attention (GQA): each K/V head
    # serves n_heads / n_kv_heads query heads, and only K/V heads are cached
    n_heads: int | None = None

    def __post_init__(self) -> None:
        _positive(f"ModelConfig {self.name!r}: n_params", self.n_params)
        for what in ("n_layers", "n_kv_heads", "head_dim"):
            _positive_int(f"ModelConfig {self.name!r}: {what}", getattr(self, what))
        if self.n_heads is not None:
            _positive_int(f"ModelConfig {self.name!r}: n_heads", self.n_heads)
            _require(self.n_heads % self.n_kv_heads == 0, f"ModelConfig {self.name!r}: n_heads",
                     self.n_heads, f"a multiple of n_kv_heads ({self.n_kv_heads})")


DEVICES = {
    d.name: d
    for d in [
        # H100 SXM / H200 datasheets: 80 GB HBM3, 3.35 TB/s / 141 GB HBM3e, 4.8 TB/s;
        # 989 TFLOP/s bf16, 1,979 fp8 (dense), 67 fp32
        Device("H100 SXM", 80e9, 3.35e12, {"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 67e12}),
        Device("H200", 141e9, 4.8e12, {"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 67e12}),
        # H100 NVL / H200 NVL (PCIe boards, lower clocks) datasheets: 94 GB HBM3, 3.9 TB/s /
        # 141 GB HBM3e, 4.8 TB/s; 1,671 TFLOP/s bf16 and 3,341 fp8 WITH sparsity, so 835.5 and
        # 1,670.5 dense; 60 fp32 (H100 NVL)
        Device("H100 NVL", 94e9, 3.9e12, {"bf16": 835.5e12, "fp8": 1670.5e12, "fp32": 60e12}),
        Device("H200 NVL", 141e9, 4.8e12, {"bf16": 835.5e12, "fp8": 1670.5e12}),
        # GH200 Grace Hopper datasheet: the H100 of an SXM board (same peaks) with 96 GB HBM3 at
        # 4 TB/s, or 144 GB HBM3e at 4.9 TB/s
        Device("GH200", 96e9, 4.0e12, {"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 67e12}),
        Device("GH200 144GB", 144e9, 4.9e12, {"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 67e12}),
        # A100 datasheet (SXM): 80 GB, 2,039 GB/s, 312 TFLOP/s bf16, 19.5 fp32; no fp8 (sm_80)
        Device("A100 80GB", 80e9, 2.039e12, {"bf16": 312e12, "fp8": None, "fp32": 19.5e12}),
        # Blackwell launch figures / HGX B200 per GPU: 192 GB HBM3e, 8 TB/s, 2.25 / 4.5 PFLOP/s
        # bf16 / fp8 and 9 PFLOP/s dense FP4 (HGX B200: 144 PFLOP/s FP4 with sparsity for 8
        # GPUs). The DGX B200 datasheet lists 1,440 GB and 64 TB/s for 8 GPUs: 180 GB each.
        Device("B200", 192e9, 8.0e12, {"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12}),
        # Ada (sm_89) has FP8 tensor cores too. Ada whitepaper, RTX 4090: 24 GB GDDR6X,
        # 1,008 GB/s; 165.2 TFLOP/s bf16 and 330.3 fp8 with fp32 accumulate, 82.6 fp32
        Device("RTX 4090", 24e9, 1.008e12, {"bf16": 165.2e12, "fp8": 330.3e12, "fp32": 82.6e12}),
        # L4 datasheet: 24 GB GDDR6, 300 GB/s; 242 TFLOP/s bf16 and 485 fp8 WITH sparsity,
        # so 121 and 242.5 dense; 30.3 fp32
        Device("L4", 24e9, 0.3e12, {"bf16": 121e12, "fp8": 242.5e12, "fp32": 30.3e12}),
        # L40S datasheet: 48 GB GDDR6, 864 GB/s; 362.05 TFLOP/s bf16 and 733 fp8 dense
        # (733 / 1,466 with sparsity); 91.6 fp32
        Device("L40S", 48e9, 0.864e12, {"bf16": 362.05e12, "fp8": 733e12, "fp32": 91.6e12}),
    ]
}

MODELS = {
    m.name: m
    for m in [
        # Hugging Face config.json of each model: num_hidden_layers, num_key_value_heads,
        # hidden_size / num_attention_heads, num_attention_heads. Parameter counts: the size
        # Hugging Face shows for each checkpoint ("Model size"), counted from its safetensors
        # files.
        ModelConfig("Llama-2-7B", 6.74e9, 32, 32, 128, n_heads=32),
        ModelConfig("Llama-2-70B", 69.0e9, 80, 8, 128, n_heads=64),
        ModelConfig("Llama-3-8B", 8.03e9, 32, 8, 128, n_heads=32),
        ModelConfig("Llama-3-70B", 70.6e9, 80, 8, 128, n_heads=64),
    ]
}


def bits_per_weight(
    bits: float, group_size: int | None = None, scale_bits: float = 16, zero_bits: float = 0
) -> float:
    """Storage bits per weight: bits + (scale_bits + zero_bits) / group_size.

    bits_per_weight(4, 128, 16, 4) == 4.15625. group_size None: per-tensor, no overhead.
    """
    _positive("bits", bits)
    _non_negative("scale_bits", scale_bits)
    _non_negative("zero_bits", zero_bits)
    if group_size is None:
        return float(bits)
    _positive_int("group_size", group_size)
    return bits + (scale_bits + zero_bits) / group_size


def weight_bytes(n_params: float, bits_per_weight: float) -> float:
    """Bytes to store n_params weights: 70e9 at 16 bits is 140e9 bytes."""
    _non_negative("n_params", n_params)
    _positive("bits_per_weight", bits_per_weight)
    return n_params * bits_per_weight / 8


def decode_ceiling_tokens_per_s(weight_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Batch-1 decode ceiling: every weight byte crosses the bus once per token."""
    _positive("weight_bytes", weight_bytes)
    _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return bandwidth_bytes_per_s / weight_bytes


def decode_ceiling_per_sequence(
    weight_bytes: float, kv_bytes_per_sequence: float, n_sequences: int,
    bandwidth_bytes_per_s: float,
) -> float:
    """Decode ceiling of EACH of n_sequences decoded together, in tokens/s.

    Every step reads every weight once (shared by the batch) and every sequence's KV cache
    once: bandwidth / (weight_bytes + n_sequences * kv_bytes_per_sequence). The machine's
    total is n_sequences times this. kv_bytes_per_sequence = kv_cache_bytes_per_token x
    the tokens in that sequence's context. Compute is assumed not to be the limit.
    """
    _positive("weight_bytes", weight_bytes)
    _non_negative("kv_bytes_per_sequence", kv_bytes_per_sequence)
    _positive_int("n_sequences", n_sequences)
    _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return bandwidth_bytes_per_s / (weight_bytes + n_sequences * kv_bytes_per_sequence)


def _model(model) -> ModelConfig:
    if isinstance(model, str) and model not in MODELS:
        raise KeyError(f"no model preset {model!r}; choose from {sorted(MODELS)} "
                       "or pass a cost.ModelConfig")
    return MODELS[model] if isinstance(model, str) else model


def _device(device) -> Device:
    if isinstance(device, str) and device not in DEVICES:
        raise KeyError(f"no device preset {device!r}; choose from {sorted(DEVICES)} "
                       "or pass a cost.Device")
    return DEVICES[device] if isinstance(device, str) else device


def kv_cache_bytes_per_token(model: ModelConfig | str, kv_bits: float = 16) -> float:
    """layers x kv_heads x head_dim x 2 (K and V) x bytes per element."""
    _positive("kv_bits", kv_bits)
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
    _positive_int("context_len", context_len)
    _positive_int("n_devices", n_devices)
    _non_negative("reserve_bytes", reserve_bytes)
    m, d = _model(model), _device(device)
    free = n_devices * d.memory_bytes - weight_bytes(m.n_params, bits_per_weight) - reserve_bytes
    per_seq = kv_cache_bytes_per_token(m, kv_bits) * context_len
    return max(0, math.floor(free / per_seq))
