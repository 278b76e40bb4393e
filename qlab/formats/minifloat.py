"""One generic minifloat codec: sign / exponent / mantissa with a bias and a NaN/inf policy.

Serves fp8_e4m3fn, fp8_e5m2, fp6_e2m3fn, fp6_e3m2fn, fp4_e2m1fn and e8m0fnu
(names as ml_dtypes names them: "f" = finite, no inf; "n" = NaN only at the outer range,
if at all; "u" = unsigned).

Value of a code with exponent field E and mantissa field M (m mantissa bits):
    E > 0:  (-1)^s * 2^(E - bias) * (1 + M / 2^m)      (normal)
    E == 0: (-1)^s * 2^(1 - bias) * (M / 2^m)          (subnormal; e8m0 has none: 2^-127)

Encoding is round-half-to-even on the float32 bits, done in integers so it is exact:
for magnitudes in the normal range the dropped mantissa bits are rounded into the
kept ones (a carry may bump the exponent, which is what RNE wants); below the
smallest normal, the magnitude divided by the subnormal step is rounded with
torch.round (half to even) - an exact power-of-two scaling.

Overflow (qlab's convention, DESIGN.md): saturate=True (default) clamps to +-max,
infinities included - like the OCP MX spec.
saturate=False overflows like ml_dtypes: NaN for fp8_e4m3fn and e8m0fnu, inf for
fp8_e5m2. FP6/FP4 have neither NaN nor inf and always saturate. Inputs are
float32 (wider inputs are rounded to float32 first). -0.0 keeps its sign.

NaN input: the format's NaN code (e4m3fn: S.1111.111; e5m2: S.11111.11 as torch
writes it, ml_dtypes writes S.11111.10; e8m0fnu: 0xFF). FP6/FP4 cannot hold NaN:
encode raises. e8m0fnu has no zero and no sign: 0 and negatives encode to NaN, and
a tie rounds up (ml_dtypes' rule: the significand 1.0 counts as odd).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qlab._tensor import as_float32


@dataclass(frozen=True)
class Minifloat:
    name: str
    exp_bits: int
    man_bits: int
    bias: int
    signed: bool = True
    nan: str | None = None  # None | "all_ones" (S.1111.111) | "ieee" (E all ones, M != 0)
    inf: bool = False  # IEEE infinities (E all ones, M == 0)
    subnormals: bool = True
    _table: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = [self._decode_one(c) for c in range(2**self.bits)]
        table = torch.tensor(table, dtype=torch.float64)
        object.__setattr__(self, "_table", table.to(torch.float32))

    # ---- layout -------------------------------------------------------------
    @property
    def bits(self) -> int:
        return int(self.signed) + self.exp_bits + self.man_bits

    @property
    def kind(self) -> str:
        return "float"

    def fields(self, code: int) -> dict:
        """Split a code into its fields, for the notebooks: sign, exponent, mantissa, value."""
        code = int(code)
        if not 0 <= code < 2**self.bits:
            raise ValueError(f"{self.name} codes are 0..{2**self.bits - 1}, got {code}")
        mag_bits = self.exp_bits + self.man_bits
        sign = (code >> mag_bits) & 1 if self.signed else 0
        exponent = (code >> self.man_bits) & ((1 << self.exp_bits) - 1)
        mantissa = code & ((1 << self.man_bits) - 1)
        binary = format(code, f"0{self.bits}b")
        parts = ([binary[0]] if self.signed else []) + [
            binary[int(self.signed): int(self.signed) + self.exp_bits],
            binary[int(self.signed) + self.exp_bits:],
        ]
        return {
            "code": code,
            "bits": ".".join(p for p in parts if p),
            "sign": sign,
            "exponent": exponent,
            "mantissa": mantissa,
            "unbiased_exponent": (max(exponent, 1) if self.subnormals else exponent) - self.bias,
            "subnormal": self.subnormals and exponent == 0,
            "value": float(self._table[code]),
        }

    def _decode_one(self, code: int) -> float:
        mag_bits = self.exp_bits + self.man_bits
        sign = -1.0 if self.signed and (code >> mag_bits) & 1 else 1.0
        e = (code >> self.man_bits) & ((1 << self.exp_bits) - 1)
        m = code & ((1 << self.man_bits) - 1)
        e_all, m_all = (1 << self.exp_bits) - 1, (1 << self.man_bits) - 1
        if self.nan == "all_ones" and e == e_all and m == m_all:
            return float("nan")
        if self.nan == "ieee" and e == e_all:
            return sign * float("inf") if m == 0 else float("nan")
        if e == 0 and self.subnormals:
            return sign * 2.0 ** (1 - self.bias) * (m / 2**self.man_bits)
        return sign * 2.0 ** (e - self.bias) * (1 + m / 2**self.man_bits)

    # ---- the grid -----------------------------------------------------------
    @property
    def values(self) -> torch.Tensor:
        """Every finite representable value, ascending (+0 and -0 listed once), float32."""
        t = self._table
        return torch.unique(t[torch.isfinite(t)])

    @property
    def max(self) -> float:
        return float(self.values[-1])

    @property
    def emax(self) -> int:
        """Exponent of the largest normal (OCP MX v1.0 calls it emax_elem)."""
        return int(torch.floor(torch.log2(torch.tensor(self.max))).item())

    @property
    def _max_mag(self) -> int:
        """Magnitude code (sign stripped) of the largest finite value."""
        return int(torch.argmax(torch.where(torch.isfinite(self._table), self._table, -1.0)))

    @property
    def nan_code(self) -> int | None:
        if self.nan == "all_ones":
            return (1 << (self.exp_bits + self.man_bits)) - 1
        if self.nan == "ieee":
            return (1 << (self.exp_bits + self.man_bits)) - 1  # torch's choice: mantissa all ones
        return None

    # ---- codec --------------------------------------------------------------
    def encode(self, x, saturate: bool = True) -> torch.Tensor:
        """float -> uint8 codes, round-half-to-even (see the module docstring).

        FP8 formats take torch's native float8 cast where this torch has one (a fused
        C++ loop, ~10x faster than the generic integer code below). Within +-max the two
        give the same codes bit for bit. Past +-max torch's casts differ by version (e4m3fn:
        NaN for 1e4 in torch 2.11, seen on a GPU machine, +-max in 2.13; e5m2: inf from
        61440 up), so to saturate the input is first clamped to +-max (NaN stays NaN),
        which on the grid is the same as rounding and then saturating.
        tests/formats/test_minifloat.py checks all of it (10^6 values).
        """
        x = as_float32(x)
        fast = _TORCH_FP8.get(self.name)
        if fast is not None and (saturate or self.inf):
            if saturate:
                x = x.clamp(-self.max, self.max)
            return x.to(fast).view(torch.uint8)
        return self.encode_generic(x, saturate)

    def encode_generic(self, x, saturate: bool = True) -> torch.Tensor:
        """The generic codec, on chunks small enough to stay in cache."""
        x = as_float32(x)
        flat, out = x.reshape(-1), torch.empty(x.numel(), dtype=torch.uint8)
        for i in range(0, flat.numel(), _CHUNK):
            out[i : i + _CHUNK] = self._encode_chunk(flat[i : i + _CHUNK], saturate)
        return out.reshape(x.shape)

    def _encode_chunk(self, x: torch.Tensor, saturate: bool) -> torch.Tensor:
        bits = x.view(torch.int32)
        a_bits = torch.clamp(bits & 0x7FFFFFFF, max=0x7F800000)  # |x| as bits; NaN -> inf for now
        m, shift = self.man_bits, 23 - self.man_bits
        # Normal range: RNE on the bits (a carry into the exponent is correct rounding).
        # e8m0 (no mantissa): ties round up, as ml_dtypes does.
        tie_even = ((a_bits >> shift) & 1) if m > 0 else 1
        rounded = a_bits + ((1 << (shift - 1)) - 1) + tie_even
        mag = (rounded >> shift) - ((127 - self.bias) << m)
        if self.subnormals:
            emin = 1 - self.bias
            a = a_bits.view(torch.float32)
            sub = torch.round(a * 2.0 ** (m - emin))  # exact scaling, then RNE
            mag = torch.where(a < 2.0**emin, sub.to(torch.int32), mag)
        else:  # e8m0: float32 subnormals hold 2^-127 (code 0) and ties up to 2^-126 (code 1)
            mag = torch.where(a_bits < 0x800000, (a_bits >= 0x600000).to(torch.int32), mag)
        mag = torch.clamp(mag, min=0)
        max_mag = self._max_mag
        if saturate or self.nan_code is None:
            mag = torch.clamp(mag, max=max_mag)
        else:
            inf_code = (1 << (self.exp_bits + self.man_bits)) - (1 << m)  # S.11111.00
            overflow = inf_code if self.inf else self.nan_code
            mag = torch.where(mag > max_mag, overflow, mag)
        if not bool(torch.isfinite(x.sum())):  # cheap screen; NaN needs its own code
            isnan = torch.isnan(x)
            if self.nan_code is None and bool(isnan.any()):
                raise ValueError(f"{self.name} has no NaN code; {int(isnan.sum())} NaN input(s)")
            if self.nan_code is not None:
                mag = torch.where(isnan, self.nan_code, mag)
        if self.signed:
            n = self.exp_bits + self.man_bits
            code = mag | ((bits >> (31 - n)) & (1 << n))  # the sign bit moved into place
        else:  # e8m0fnu: no sign, no zero -> NaN
            code = torch.where((bits < 0) | (x == 0), self.nan_code, mag)
        return code.to(torch.uint8)

    def decode(self, codes) -> torch.Tensor:
        """uint8 codes -> float32 values (a table lookup over all 2^bits codes)."""
        codes = torch.as_tensor(codes)
        if codes.is_floating_point():
            raise TypeError(f"{self.name}.decode takes integer codes, got {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**self.bits):
            raise ValueError(f"{self.name} codes are 0..{2**self.bits - 1}")
        flat, out = codes.reshape(-1), torch.empty(codes.numel(), dtype=torch.float32)
        for i in range(0, flat.numel(), _CHUNK):
            out[i : i + _CHUNK] = self._table[flat[i : i + _CHUNK].to(torch.int64)]
        return out.reshape(codes.shape)


_CHUNK = 1 << 16  # elements per chunk: the temporaries stay in cache
_TORCH_FP8 = {
    name: getattr(torch, dtype)
    for name, dtype in [("fp8_e4m3fn", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")]
    if hasattr(torch, dtype)
}

FP8_E4M3FN = Minifloat("fp8_e4m3fn", 4, 3, 7, nan="all_ones")  # max 448
FP8_E5M2 = Minifloat("fp8_e5m2", 5, 2, 15, nan="ieee", inf=True)  # max 57344
FP6_E2M3FN = Minifloat("fp6_e2m3fn", 2, 3, 1)  # max 7.5
FP6_E3M2FN = Minifloat("fp6_e3m2fn", 3, 2, 3)  # max 28
FP4_E2M1FN = Minifloat("fp4_e2m1fn", 2, 1, 1)  # max 6
E8M0FNU = Minifloat(  # 2^(E - 127), E = 0..254; 0xFF is NaN
    "e8m0fnu", 8, 0, 127, signed=False, nan="all_ones", subnormals=False
)
