"""Element grids by name: qlab.formats.get("fp8_e4m3fn").encode(x) etc.

Every grid has .name, .bits, .values (finite values, ascending, float32), .max,
.encode(x, saturate=True) -> integer codes, .decode(codes) -> float32, .fields(code).
Names follow ml_dtypes: fp8_e4m3fn, fp8_e5m2, fp6_e2m3fn, fp6_e3m2fn, fp4_e2m1fn,
e8m0fnu; integer grids int2..int8 (symmetric, -qmax..qmax) and uint2..uint8; nf4.
"""

from __future__ import annotations

import re

from qlab.formats.grid import Grid
from qlab.formats.integer import MAX_BITS, MIN_BITS, IntGrid
from qlab.formats.minifloat import (
    E8M0FNU,
    FP4_E2M1FN,
    FP6_E2M3FN,
    FP6_E3M2FN,
    FP8_E4M3FN,
    FP8_E5M2,
    Minifloat,
)
from qlab.formats.nf4 import NF4, NF4_LEVELS, quantile_levels

FLOATS = {f.name: f for f in (FP8_E4M3FN, FP8_E5M2, FP6_E2M3FN, FP6_E3M2FN, FP4_E2M1FN, E8M0FNU)}
_INTS = {f"{p}{b}": IntGrid(b, p == "int") for p in ("int", "uint") for b in range(2, 9)}


def get(name: str) -> Grid:
    """The element grid called `name` (see the module docstring for the names)."""
    if name in FLOATS:
        return FLOATS[name]
    if name in _INTS:
        return _INTS[name]
    if name == "nf4":
        return NF4
    m = re.fullmatch(r"u?int(\d+)", str(name))
    if m:
        raise ValueError(f"integer grids take {MIN_BITS}..{MAX_BITS} bits, got {name!r}")
    raise KeyError(f"unknown format {name!r}; known: {', '.join(names())}")


def names() -> list[str]:
    return list(FLOATS) + ["nf4"] + list(_INTS)


__all__ = ["get", "names", "Grid", "Minifloat", "IntGrid", "NF4_LEVELS", "quantile_levels"]
