"""Integer element grids: signed symmetric int{b} (-qmax..qmax) and unsigned uint{b}.

Symmetric signed grids leave -2^(b-1) unused (int4 is -7..7, not -8..7): the grid is
then symmetric around zero, so +absmax and -absmax both come back exactly, and the
dequantizer is one multiply. Encoding is round-half-to-even (torch.round) then clamp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlab._tensor import as_float32

MIN_BITS, MAX_BITS = 2, 8


@dataclass(frozen=True)
class IntGrid:
    bits: int
    signed: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.bits, int) and MIN_BITS <= self.bits <= MAX_BITS):
            raise ValueError(
                f"integer grids take {MIN_BITS}..{MAX_BITS} bits, got {self.bits!r}; "
                "use fp formats or more bits"
            )

    @property
    def name(self) -> str:
        return f"int{self.bits}" if self.signed else f"uint{self.bits}"

    @property
    def kind(self) -> str:
        return "int"

    @property
    def qmin(self) -> int:
        return -self.qmax if self.signed else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def max(self) -> float:
        return float(self.qmax)

    @property
    def values(self) -> torch.Tensor:
        return torch.arange(self.qmin, self.qmax + 1, dtype=torch.float32)

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.signed else torch.uint8

    def encode(self, x, saturate: bool = True) -> torch.Tensor:
        """Round half to even, then clamp to [qmin, qmax] (integers always saturate)."""
        x = as_float32(x)
        if bool(torch.isnan(x).any()):
            raise ValueError(f"{self.name} has no NaN code")
        return torch.clamp(torch.round(x), self.qmin, self.qmax).to(self.code_dtype)

    def decode(self, codes) -> torch.Tensor:
        codes = torch.as_tensor(codes)
        if codes.is_floating_point():
            raise TypeError(f"{self.name}.decode takes integer codes, got {codes.dtype}")
        return codes.to(torch.float32)

    def fields(self, code: int) -> dict:
        code = int(code)
        raw = code & (2**self.bits - 1)
        return {"code": code, "bits": format(raw, f"0{self.bits}b"), "value": float(code)}
