"""A quantization scheme = an element grid + a scale rule + a granularity.

Every scheme of the course is one row of SCHEMES below, not a code path of its own.

scale rules (implemented in qlab/scales.py):
    absmax  symmetric: s = absmax / grid.max, elements = grid.encode(x / s)
    minmax  asymmetric: s = (max - min) / (levels - 1), integer zero point z
    nf4     absmax, but x is multiplied by fp32(1/absmax) (bitsandbytes' order)
    e8m0    OCP MX v1.0 shared power-of-two scale
    nvfp4   E4M3 block scale under an FP32 per-tensor scale
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from qlab import formats
from qlab.formats.integer import MAX_BITS, MIN_BITS

Granularity = str | int  # "tensor" | "channel" | group size along the last axis


@dataclass(frozen=True)
class Scheme:
    name: str
    element: str  # a qlab.formats name
    scale_rule: str  # "absmax" | "minmax" | "nf4" | "e8m0" | "nvfp4"
    default_granularity: Granularity = "tensor"
    block: int | None = None  # a block size the format fixes (MX 32, NVFP4 16)
    scale_bits: int = 16  # bits of one stored scale
    zero_bits: int = 0  # bits of one stored zero point
    scale_dtype: torch.dtype = torch.float16  # how scales are stored (never bf16)
    double_quant: bool = False  # NF4: quantize the block absmax values again

    @property
    def grid(self):
        return formats.get(self.element)


def int_scheme(bits: int, symmetric: bool = True) -> Scheme:
    """Integer scheme of `bits` (2..8): symmetric int{b} or asymmetric uint{b}_asym."""
    if not (isinstance(bits, int) and MIN_BITS <= bits <= MAX_BITS):
        raise ValueError(f"integer schemes take {MIN_BITS}..{MAX_BITS} bits, got {bits!r}")
    if symmetric:
        return Scheme(f"int{bits}", f"int{bits}", "absmax")
    return Scheme(f"uint{bits}_asym", f"uint{bits}", "minmax", zero_bits=bits)


def _mx(name: str, element: str) -> Scheme:
    return Scheme(name, element, "e8m0", 32, 32, 8, 0, torch.float32)


_F32 = dict(scale_bits=32, scale_dtype=torch.float32)
SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in [
        int_scheme(8),
        int_scheme(4),
        Scheme("int4_asym", "uint4", "minmax", zero_bits=4),
        Scheme("uint8_asym", "uint8", "minmax", zero_bits=8),
        Scheme("nf4", "nf4", "nf4", 64, **_F32),
        Scheme("nf4_dq", "nf4", "nf4", 64, double_quant=True, **_F32),
        Scheme("fp8_e4m3", "fp8_e4m3fn", "absmax", **_F32),
        Scheme("fp8_e5m2", "fp8_e5m2", "absmax", **_F32),
        _mx("mxfp8_e4m3", "fp8_e4m3fn"),
        _mx("mxfp8_e5m2", "fp8_e5m2"),
        _mx("mxfp6_e2m3", "fp6_e2m3fn"),
        _mx("mxfp6_e3m2", "fp6_e3m2fn"),
        _mx("mxfp4", "fp4_e2m1fn"),
        Scheme("nvfp4", "fp4_e2m1fn", "nvfp4", 16, 16, 8, 0, torch.float32),
    ]
}
SCHEME_NAMES = tuple(SCHEMES)


def get_scheme(scheme: str | Scheme) -> Scheme:
    """A Scheme from its name (see SCHEME_NAMES; also int2..int8 and int{b}_asym/uint{b}_asym)."""
    if isinstance(scheme, Scheme):
        return scheme
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a name or a qlab.Scheme, got {type(scheme).__name__}")
    if scheme in SCHEMES:
        return SCHEMES[scheme]
    m = re.fullmatch(r"(u?)int(\d+)(_asym)?", scheme)
    if m and (m.group(1) == "u") <= bool(m.group(3)):
        return int_scheme(int(m.group(2)), symmetric=not m.group(3))
    raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEME_NAMES)}")
