"""A quantization scheme = an element grid + a scale rule + a granularity.

Every scheme of the course is one row of SCHEMES below, not a code path of its own.

scale rules (implemented in qlab/scales.py):
    absmax  symmetric: s = absmax / grid.max, elements = grid.encode(x / s)
    minmax  asymmetric: s = (max - min) / (levels - 1), integer zero point z
    nf4     absmax, but x is multiplied by fp32(1/absmax) (bitsandbytes' order)
    e8m0    OCP MX v1.0 shared power-of-two scale
    nvfp4   E4M3 block scale under an FP32 per-tensor scale
    ggml_q8_0  llama.cpp's Q8_0: s = absmax / 127, codes = roundf(x * (1 / s)) (half away)
    ggml_q4_0  llama.cpp's Q4_0 / Q5_0: s = signed max / -2^(b-1), unsigned codes with an
               implied offset 2^(b-1) (the zero_points), q = min(2^b - 1,
               trunc(x * (1 / s) + 2^(b-1) + 0.5))
The GGUF formats that do not fit one scale per block (Q4_1, Q5_1, the K-quants) live in
qlab/gguf, which also writes and reads the files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from qlab import formats
from qlab.formats import Grid
from qlab.formats.integer import MAX_BITS, MIN_BITS

Granularity = str | int  # "tensor" | "channel" | group size along the last axis
ScaleRule = Literal[
    "absmax", "minmax", "nf4", "e8m0", "nvfp4", "ggml_q8_0", "ggml_q4_0"
]  # see qlab/scales.py


@dataclass(frozen=True)
class Scheme:
    name: str
    element: str  # a qlab.formats name
    scale_rule: ScaleRule
    default_granularity: Granularity = "tensor"
    block: int | None = None  # a block size the format fixes (MX 32, NVFP4 16)
    scale_bits: int = 16  # bits of one stored scale
    zero_bits: int = 0  # bits of one stored zero point
    scale_dtype: torch.dtype = torch.float16  # how scales are stored (never bf16)
    double_quant: bool = False  # NF4: quantize the block absmax values again

    @property
    def grid(self) -> Grid:
        return formats.get(self.element)


def int_scheme(bits: int, symmetric: bool = True) -> Scheme:
    """Integer scheme of `bits` (2..8): symmetric int{b} or asymmetric uint{b}_asym."""
    if not (isinstance(bits, int) and MIN_BITS <= bits <= MAX_BITS):
        raise ValueError(f"integer schemes take {MIN_BITS}..{MAX_BITS} bits, got {bits!r}")
    if symmetric:
        return Scheme(name=f"int{bits}", element=f"int{bits}", scale_rule="absmax")
    return Scheme(
        name=f"uint{bits}_asym", element=f"uint{bits}", scale_rule="minmax", zero_bits=bits
    )


def _mx(name: str, element: str) -> Scheme:
    """OCP MX v1.0: blocks of 32 sharing one E8M0 (8-bit power-of-two) scale."""
    return Scheme(
        name=name, element=element, scale_rule="e8m0", block=32, scale_bits=8,
        scale_dtype=torch.float32,  # E8M0 values held as fp32 (exact: powers of two)
    )  # fmt: skip


_F32 = dict(scale_bits=32, scale_dtype=torch.float32)
SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in [
        int_scheme(8),
        int_scheme(4),
        Scheme(name="int4_asym", element="uint4", scale_rule="minmax", zero_bits=4),
        Scheme(name="uint8_asym", element="uint8", scale_rule="minmax", zero_bits=8),
        Scheme(name="nf4", element="nf4", scale_rule="nf4", default_granularity=64, **_F32),
        Scheme(
            name="nf4_dq", element="nf4", scale_rule="nf4", default_granularity=64,
            double_quant=True, **_F32,
        ),  # fmt: skip
        Scheme(name="fp8_e4m3", element="fp8_e4m3fn", scale_rule="absmax", **_F32),
        Scheme(name="fp8_e5m2", element="fp8_e5m2", scale_rule="absmax", **_F32),
        _mx("mxfp8_e4m3", "fp8_e4m3fn"),
        _mx("mxfp8_e5m2", "fp8_e5m2"),
        _mx("mxfp6_e2m3", "fp6_e2m3fn"),
        _mx("mxfp6_e3m2", "fp6_e3m2fn"),
        _mx("mxfp4", "fp4_e2m1fn"),
        Scheme(
            name="nvfp4", element="fp4_e2m1fn", scale_rule="nvfp4", block=16, scale_bits=8,
            scale_dtype=torch.float32,  # E4M3 block scale values held as fp32 (exact)
        ),  # fmt: skip
        # GGUF (llama.cpp) blocks of 32 with one fp16 scale: 8.5, 4.5 and 5.5 bits per weight.
        # Q4_0/Q5_0 codes are unsigned; the offset 2^(b-1) is implied by the format, not stored.
        Scheme(name="q8_0", element="int8", scale_rule="ggml_q8_0", block=32),
        Scheme(name="q4_0", element="uint4", scale_rule="ggml_q4_0", block=32),
        Scheme(name="q5_0", element="uint5", scale_rule="ggml_q4_0", block=32),
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
