"""Where values return to high precision: W4A16 and W8A8 reference pipelines.

W4A16 (weight-only): int4 weights cross the bus, are dequantized, and the matmul
runs in high precision -> a bandwidth gain, no arithmetic gain.
W8A8: activations are quantized on the fly (per token or per tensor), the 8-bit
elements are multiplied and accumulated in high precision (int8 exactly, fp8 in fp32 here;
Hopper's FP8 tensor cores keep fewer bits in their sums, notebook 06), and the
accumulator is rescaled ONCE at the end by s_x[:, None] * s_w[None, :].
The kernels of notebooks 09-10 are tested against these.
"""

from __future__ import annotations

import torch

from qlab._tensor import as_float32
from qlab.quantize import dequantize, quantize
from qlab.schemes import get_scheme

__all__ = ["w4a16_reference", "w8a8_reference"]


def w4a16_reference(x, weight, group_size: int = 128) -> torch.Tensor:
    """x (..., K) @ W_hat.T with W_hat = int4 group-quantized weight (N, K); float32 out."""
    w_hat = dequantize(quantize(weight, "int4", group_size))
    return as_float32(x) @ w_hat.T


def w8a8_reference(
    x,
    weight,
    scheme: str = "fp8_e4m3",
    weight_granularity: str = "channel",
    act_granularity: str = "token",
) -> torch.Tensor:
    """x (M, K), weight (N, K) -> (M, N) float32.

    scheme: "fp8_e4m3" (elements E4M3; products exact in fp32, fp32 accumulate) or
    "int8" (integer products accumulated exactly, like an int32 accumulator).
    act_granularity: "token" (one scale per row of x) or "tensor".
    weight_granularity: "channel" (one scale per output row) or "tensor".
    """
    if act_granularity not in ("token", "tensor"):
        raise ValueError(f"act_granularity must be 'token' or 'tensor', got {act_granularity!r}")
    if weight_granularity not in ("channel", "tensor"):
        raise ValueError("weight_granularity must be 'channel' or 'tensor'")
    grid = get_scheme(scheme).grid
    x = as_float32(x)
    qx = quantize(x, scheme, "channel" if act_granularity == "token" else "tensor")
    qw = quantize(weight, scheme, weight_granularity)
    ex, ew = grid.decode(qx.codes), grid.decode(qw.codes)
    if grid.kind == "int":  # exact integer accumulation (int32 on hardware)
        acc = (ex.double() @ ew.double().T).float()
    else:
        acc = ex @ ew.T
    sx = qx.scales.float().reshape(-1, 1) if act_granularity == "token" else qx.scales.float()
    sw = qw.scales.float().reshape(1, -1) if weight_granularity == "channel" else qw.scales.float()
    return acc * (sx * sw)
