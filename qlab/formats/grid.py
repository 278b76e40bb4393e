"""The interface every element grid offers (IntGrid, Minifloat, NF4Grid), as a Protocol.

A grid is the set of values one element can take; encode rounds to it, decode reads it.
Scale rules (qlab/scales.py) and the notebooks use only what is listed here.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Grid(Protocol):
    name: str  # ml_dtypes-style name: "int4", "fp8_e4m3fn", "nf4", ...
    bits: int  # bits of one element code
    kind: str  # "int" | "float" | "nf4"

    @property
    def values(self) -> torch.Tensor:
        """Every finite representable value, ascending, float32."""

    @property
    def max(self) -> float:
        """Largest finite value (what a scale maps absmax onto)."""

    def encode(self, x, saturate: bool = True) -> torch.Tensor:
        """Real values -> integer codes (round to nearest; ties per the format)."""

    def decode(self, codes) -> torch.Tensor:
        """Integer codes -> float32 values."""

    def fields(self, code: int) -> dict:
        """One code split into its fields, for the notebooks."""
