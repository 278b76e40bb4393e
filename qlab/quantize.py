"""qlab.quantize / dequantize / fake_quantize: every scheme through one path.

    blocks  = x reshaped to (R, G, g)  by granularity (tensor, channel, group)
    codes, scales, zero_points = scheme's scale rule (qlab/scales.py) on the blocks
    x_hat   = scale * (grid.decode(codes) - zero_point)      [NVFP4: * tensor_scale too]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlab._tensor import as_float32, check_finite
from qlab.scales import NF4_DQ_BLOCK, RULES
from qlab.schemes import Granularity, Scheme, get_scheme

__all__ = ["QTensor", "quantize", "dequantize", "fake_quantize"]


@dataclass
class QTensor:
    """A quantized tensor: unpacked integer codes plus the metadata to reconstruct x.

    codes:        x's shape; int8 (symmetric int), uint8 (asymmetric int, float codes, nf4)
    scales:       () for "tensor", else x.shape[:-1] + (groups,); fp16 for int schemes
    zero_points:  like scales (uint8), None when symmetric
    tensor_scale: NVFP4's fp32 per-tensor scale, else None
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    scheme: Scheme
    granularity: Granularity
    tensor_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def group_size(self) -> int:
        """Elements that share one scale."""
        if self.granularity == "tensor":
            return max(self.codes.numel(), 1)
        if self.granularity == "channel":
            return self.codes.shape[-1] if self.codes.ndim else 1
        return int(self.granularity)

    @property
    def bits_per_element(self) -> float:
        """Element bits + per-group/per-channel metadata bits per element.

        One scale (and zero point) for a whole tensor - and NVFP4's fp32 tensor scale -
        is not counted: 16 or 32 bits over a tensor of millions is 0.0000-something.
        """
        bits = float(self.scheme.grid.bits)
        if self.granularity == "tensor":
            return bits
        meta = self.scheme.scale_bits + self.scheme.zero_bits
        if self.scheme.double_quant:  # 8-bit absmax + one fp32 per 256 of them
            meta = 8 + 32 / NF4_DQ_BLOCK
        return bits + meta / self.group_size

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def _resolve(scheme: Scheme, granularity, shape: torch.Size) -> Granularity:
    if granularity is None:
        granularity = scheme.block or scheme.default_granularity
    if scheme.block is not None and granularity != scheme.block:
        raise ValueError(
            f"{scheme.name} fixes blocks of {scheme.block} along the last axis; "
            f"granularity {granularity!r} is not allowed (leave it as None)"
        )
    if granularity in ("tensor", "channel"):
        return granularity
    if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0:
        raise ValueError(
            f"granularity must be 'tensor', 'channel' or a positive int group size, "
            f"got {granularity!r}"
        )
    last = shape[-1] if len(shape) else 1
    if last % granularity:
        raise ValueError(
            f"group_size {granularity} does not divide the last dimension ({last}); "
            "pad the tensor or pick a divisor"
        )
    return granularity


def _blocks(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """x -> (R, G, g)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    if granularity == "tensor":
        return x2.reshape(1, 1, -1)  # shape: (1, 1, numel)
    if granularity == "channel":
        return x2.reshape(x2.shape[0], 1, x2.shape[1])  # shape: (rows, 1, K)
    return x2.reshape(x2.shape[0], x2.shape[1] // granularity, granularity)  # (rows, K // g, g)


def quantize(x, scheme: str | Scheme, granularity: Granularity | None = None) -> QTensor:
    """Quantize x (torch or numpy, any float dtype; computed in fp32) with a scheme.

    granularity: "tensor" | "channel" (one scale per row, i.e. per index of x.shape[:-1])
    | int group size along the last axis. None takes the scheme's default
    (tensor for int/fp8, 64 for nf4; MX fixes 32, NVFP4 16).
    NaN/inf raise ValueError, except for MX schemes (NaN scale for that block).
    """
    sch = get_scheme(scheme)
    x = as_float32(x)
    gran = _resolve(sch, granularity, x.shape)
    if sch.scale_rule != "e8m0":
        check_finite(x, sch.name)
    r = RULES[sch.scale_rule](_blocks(x, gran), sch)
    meta_shape = () if gran == "tensor" else (*x.shape[:-1], r.scales.shape[-1]) if x.ndim else (1,)
    return QTensor(
        codes=r.codes.reshape(x.shape),
        scales=r.scales.reshape(meta_shape),
        zero_points=None if r.zero_points is None else r.zero_points.reshape(meta_shape),
        scheme=sch,
        granularity=gran,
        tensor_scale=r.tensor_scale,
    )


def dequantize(qt: QTensor) -> torch.Tensor:
    """x_hat = scale * (value(code) - zero_point), float32 in x's shape."""
    values = _blocks(qt.scheme.grid.decode(qt.codes), qt.granularity)
    scales = qt.scales.float().reshape(values.shape[:-1])
    if qt.zero_points is not None:
        values = values - qt.zero_points.float().reshape(values.shape[:-1])[..., None]
    if qt.tensor_scale is not None:  # NVFP4: x_hat = e * (ts * bs)
        scales = qt.tensor_scale * scales
    return (values * scales[..., None]).reshape(qt.codes.shape)


def fake_quantize(x, scheme: str | Scheme, granularity: Granularity | None = None) -> torch.Tensor:
    """dequantize(quantize(x)) returned in x's dtype and on x's device (numpy inputs come
    back as torch tensors). qlab computes on the CPU: it is the reference, not the kernel."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    out = dequantize(quantize(x, scheme, granularity))
    return out.to(device=x.device, dtype=x.dtype) if x.is_floating_point() else out
